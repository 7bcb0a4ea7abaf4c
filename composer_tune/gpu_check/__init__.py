"""The library of ``tools/gpu_check.py``, the one command that turns a GPU into evidence: one
module per part (``parity``, ``memory``, ``speed``, ``sampling``, ``peer``, ``muon``,
``async_steps``), what they share (``common``) and the report (``report``)."""
