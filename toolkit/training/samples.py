"""`train.sample_prompts`: answers generated at every evaluation, so a person sees what the model
says while it trains, not only its loss. Every rank generates the same prompts in one batch
(`synced_gpus` where there are several), because a backend that shards the weights needs every
rank in each forward pass: no rank waits alone."""

from __future__ import annotations

from ..config import Recipe
from ..data.tokenize import render


class Samples:
    def __init__(self, recipe: Recipe, tokenizer, accelerator):
        from ..model.inference import prompt_text

        self.prompts = list(recipe.train.sample_prompts)
        self.max_new_tokens = recipe.train.sample_max_new_tokens
        self.tokenizer, self.accelerator = tokenizer, accelerator
        fmt = recipe.data.format
        if fmt == "messages":
            rendered = [prompt_text(tokenizer, p) for p in self.prompts]
        elif fmt == "alpaca":  # as training renders an alpaca row without input, up to the response
            rendered = []
            for p in self.prompts:
                [(text, spans, _)] = render({"instruction": p, "input": "", "output": ""}, fmt, tokenizer)
                rendered.append((text[:spans[0][0]], False))
        else:
            rendered = [(p, True) for p in self.prompts]
        self.texts, self.add_bos = [t for t, _ in rendered], [b for _, b in rendered]

    def __bool__(self) -> bool:
        return bool(self.prompts)

    def __call__(self, model) -> list[dict]:
        from ..model.inference import generate_texts

        module = self.accelerator.unwrap_model(model)
        module.eval()
        with self.accelerator.autocast():
            answers = generate_texts(module, self.tokenizer, self.texts, add_bos=self.add_bos,
                                     max_new_tokens=self.max_new_tokens, batch_size=len(self.texts),
                                     synced=self.accelerator.num_processes > 1)
        model.train()
        return [{"prompt": p, "answer": a} for p, (a, _) in zip(self.prompts, answers)]
