"""Agent episodes: multi-turn, tool-calling rollouts in TRL 1.16's environment contract, for
every RL recipe (``agent:`` config section, :func:`build_agent`)."""

from composer_tune.agents.episodes import EpisodeRecord
from composer_tune.agents.runtime import AgentRuntime, build_agent, collect_episodes

__all__ = ["AgentRuntime", "EpisodeRecord", "build_agent", "collect_episodes"]
