"""Loaded into a vLLM server's workers (`--worker-extension-cls toolkit_vllm_worker.WeightReload`, with this
folder on the server's PYTHONPATH; it imports nothing of the toolkit, which is not in the server's environment).

Full fine-tuning's weights go into the server through vLLM's own in-place reload (`Worker.reload_weights`, a
layer re-processed as its weights arrive), called over HTTP by /collective_rpc. That reload leaves alone a
layer none of whose weights arrive: an output layer tied to the input embeddings (SmolLM2, Llama 3.2, Qwen2.5
0.5B) shares the embeddings' weight, whose values it does see, but on a CPU host vLLM prepacks that weight for
its matrix product (`dispatch_cpu_unquantized_gemm`) and the packed copy would stay the old one. So the tied
output layer is processed again after each reload (on a GPU that processing leaves an unquantized layer as it
is)."""


class WeightReload:
    def toolkit_reload_weights(self, path: str) -> None:
        self.reload_weights(weights_path=path)
        model = self.model_runner.get_model()
        head, config = getattr(model, "lm_head", None), getattr(model, "config", None)
        if head is not None and getattr(config, "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)
