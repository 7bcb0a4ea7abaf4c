"""composer-tune: torchtune-style post-training recipes (the channel ladder of Composer 2.5)
for Llama-, Qwen2- and Qwen3-family models."""
