"""The model and its tokenizer: `hub` (a local folder or a Hub id from the cache), `load` (tokenizer,
model, presets, vocabulary, LoRA, compile), `varlen` (attention over packed documents), `activations`
(tiled MLPs, activation offload), `base_identity` (which base an adapter belongs to), `inference`
(generation, for samples during training and the verbs after it), `sampling` (online RL's seeded
completions inside training). The built-in presets are JSON
configs in `presets/`."""
