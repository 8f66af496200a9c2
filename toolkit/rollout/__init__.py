"""Online RL's completions from an inference server (rl.sampler: vllm): the server's process, its HTTP
client, and the sampler the run uses (`vllm_sampler.py`)."""
