"""Online RL's completions from an inference server (rl.sampler: vllm): the server's process, its HTTP
client, and the sampler the run uses (`vllm_sampler.py`); and `tools.py`, the tool calls inside a rollout
(rl.tools: TRL's tool-calling loop, over our sampler or the server)."""
