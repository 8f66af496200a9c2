"""The loss: the sum of next-token cross-entropies over a batch's target tokens, computed one of two ways.

`full` runs the model as it is and takes the cross-entropy of its logits, so the micro-batch's
full-vocabulary logits are held in fp32, with their gradient (8 x 2,048 tokens x a 49,152-word
vocabulary is 3.2 GB per copy). `chunked` runs the model's backbone to hidden states, keeps the
positions that carry a target, and applies the output layer to `chunk_tokens` of them at a time,
each chunk under activation checkpointing: its logits are recomputed in backward, so only one
chunk's are ever held. The value is the same; only the order of the additions differs.

Both run inside the model's own forward (`use_token_loss` replaces it on the instance; the state
dict does not change), because that is where every backend makes the weights whole: ZeRO-3 gathers
a layer's parameters in its forward hooks, FSDP unshards them inside the root module's forward. So
the output layer is called as a module (LoRA-adapted or tied to the embeddings, as it is), never
through its weight.
"""

from __future__ import annotations

import functools
import math
import sys
import types

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..data.formats import IGNORE
from ..errors import ToolkitError

PAIR_COLUMNS = ("reference_logps", "margins", "kto_labels")  # a pair batch's columns that are no model input


def token_loss_sum(model, batch: dict[str, torch.Tensor], router_aux: bool = False, dft: bool = False):
    """Sum of next-token cross-entropies over the batch's target tokens (labels != IGNORE), the
    way `use_token_loss` set up; `model` as prepared (DDP, FSDP, DeepSpeed) or not. `router_aux`
    (a mixture-of-experts model): (that sum, the router's load-balancing loss of the batch). `dft`
    (train.loss_type=dft, Dynamic Fine-Tuning): each token's cross-entropy times its probability,
    detached (`dft_weighted`)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    if dft:
        inputs["token_loss_dft"] = True
    if "shift_labels" in batch:  # a sequence-parallel part: each position's own target (sequence.shard)
        return model(**inputs, token_loss_labels=batch["shift_labels"], token_loss_shifted=True)
    if router_aux:
        return model(**inputs, token_loss_labels=batch["labels"], token_loss_router_aux=True)
    return model(**inputs, token_loss_labels=batch["labels"])


def dft_weighted(losses: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropies -log p made Dynamic Fine-Tuning's -p log p, p detached (TRL 1.16's
    SFTConfig loss_type dft: the NLL times exp(log p).detach())."""
    return losses * torch.exp(-losses).detach()


def token_logps(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence of the batch (a row; in a padding-free batch, one row of documents, each
    document): the sum of the log-probabilities of its target tokens (labels != IGNORE) and how
    many there are, the way `use_token_loss` set up (through the chunked output layer under
    train.loss=chunked: no full-vocabulary logits held); a preference objective's log-likelihood of
    each completion. `model` as prepared or not. What a pair batch carries beside the model's inputs
    (`PAIR_COLUMNS`) is left out."""
    inputs = {k: v for k, v in batch.items() if k != "labels" and k not in PAIR_COLUMNS}
    return model(**inputs, token_loss_labels=batch["labels"], token_loss_per_row=sequence_index(batch))


def token_logps_each(model, batch: dict[str, torch.Tensor],
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the log-probability of each target token (labels != IGNORE), the entropy of the model's
    distribution at it (detached)), flat, in the order of the targets (row after row): an online-RL
    objective's per-token terms, through the chunked output layer where train.loss=chunked. Both of the
    distribution the completions were sampled from: the logits divided by `temperature`, as TRL's
    fused head divides them (issue 49: at T = 0.7 the loss followed log pi_1 while sampling pi_T)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, token_loss_labels=batch["labels"], token_loss_per_token=True,
                 token_loss_temperature=temperature)


def target_distributions(model, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """The model's log-probabilities over the whole vocabulary at each target position (labels != IGNORE), of
    the logits divided by `temperature`, (targets, vocabulary) in float32, in the order of the targets:
    distillation's teacher, through the chunked output layer where train.loss=chunked (only the targets'
    logits are made, a chunk at a time)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, token_loss_labels=batch["labels"], token_loss_distribution=True,
                 token_loss_temperature=temperature)


def token_divergences(model, batch: dict[str, torch.Tensor], teacher_logps: torch.Tensor, beta: float,
                      temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the divergence between the model's next-token distribution and the teacher's at each target token
    (`generalized_jsd`), the model's entropy there (detached)), flat, in the order of the targets, both
    distributions of the logits divided by `temperature`: distillation's per-token terms, through the chunked
    output layer where train.loss=chunked. `teacher_logps`: the teacher's log-probabilities at those targets,
    (targets, vocabulary), at the temperature already."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    return model(**inputs, token_loss_labels=batch["labels"], token_loss_teacher=(teacher_logps, beta),
                 token_loss_temperature=temperature)


def generalized_jsd(student: torch.Tensor, teacher: torch.Tensor, beta: float) -> torch.Tensor:
    """Per row of log-probabilities (student's with their gradient, teacher's without), TRL 1.16's
    DistillationTrainer divergence: beta 0 the forward KL(teacher || student), 1 the reverse KL(student ||
    teacher), between them beta KL(teacher || m) + (1 - beta) KL(student || m), m = (1 - beta) student + beta
    teacher."""
    if beta == 0:
        return (teacher.exp() * (teacher - student)).sum(-1)
    if beta == 1:
        return (student.exp() * (student - teacher)).sum(-1)
    mixture = torch.logaddexp(student + math.log(1 - beta), teacher + math.log(beta))
    return (beta * (teacher.exp() * (teacher - mixture)).sum(-1)
            + (1 - beta) * (student.exp() * (student - mixture)).sum(-1))


def sequence_index(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """For each position of the batch's labels after the first (those a target can sit at): the
    sequence it belongs to, rows in order and, in a padding-free row, the documents in order
    (where `position_ids` start again at 0)."""
    labels = batch["labels"]
    if labels.shape[0] == 1 and "position_ids" in batch:  # padding-free: one row of documents
        return ((batch["position_ids"][0] == 0).cumsum(0) - 1)[None, 1:]
    return torch.arange(labels.shape[0], device=labels.device)[:, None].expand(-1, labels.shape[1] - 1)


def use_token_loss(model, kind: str = "chunked", chunk_tokens: int = 1024, backend=None,
                   most_positions: int | None = None) -> None:
    """Make `model(..., token_loss_labels=labels)` return the loss sum (`kind`: "chunked" or
    "full", as train.loss); without that argument the model does what it did (generation, the
    packing check). Call it before `accelerator.prepare`. A model whose forward does more after
    its output layer than the chunked loss knows (a logit scale, say) is refused. `backend`: the
    run's (`backends.for_launch()`), which says whether calling the output layer is a collective
    (then every rank calls it equally often) and whether the weights are partitioned already;
    None: one process. `most_positions`: the most positions a batch of the run holds (its bound on
    the output layer's calls, `data.most_positions`)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the HF model inside
    original = type(model).forward.__get__(model)
    most = None if most_positions is None else max(1, math.ceil(most_positions / chunk_tokens))
    calls = functools.partial(backend.same_call_count, most=most) if backend is not None else None
    if kind == "chunked":
        check_chunked_loss(model, backend is not None and backend.partitioned_before_prepare(model))

    @functools.wraps(type(model).forward)  # its signature: generation asks it whether position_ids are taken
    def forward(self, *args, token_loss_labels=None, token_loss_router_aux=False, token_loss_per_row=None,
                token_loss_shifted=False, token_loss_per_token=False, token_loss_temperature=1.0,
                token_loss_teacher=None, token_loss_distribution=False, token_loss_dft=False, **kwargs):
        if token_loss_labels is None:
            return original(*args, **kwargs)
        if token_loss_distribution:
            if kind == "full":
                targets = token_loss_labels[:, 1:] != IGNORE
                logits = original(*args, **{**kwargs, "use_cache": False}).logits[:, :-1][targets]
                return (logits.float() / token_loss_temperature).log_softmax(-1)
            return chunked_loss_sum(self, token_loss_labels, chunk_tokens, *args, same_calls=calls,
                                    temperature=token_loss_temperature, distribution=True, **kwargs)
        if token_loss_teacher is not None:
            if kind == "full":
                return full_token_divergences(original(*args, **{**kwargs, "use_cache": False}).logits,
                                              token_loss_labels, *token_loss_teacher, token_loss_temperature)
            return chunked_loss_sum(self, token_loss_labels, chunk_tokens, *args, same_calls=calls, per_token=True,
                                    temperature=token_loss_temperature, teacher=token_loss_teacher, **kwargs)
        if token_loss_router_aux:
            kwargs["output_router_logits"] = True
        if token_loss_per_token:
            if kind == "full":
                return full_token_logps(original(*args, **{**kwargs, "use_cache": False}).logits, token_loss_labels,
                                        token_loss_temperature)
            return chunked_loss_sum(self, token_loss_labels, chunk_tokens, *args, same_calls=calls, per_token=True,
                                    temperature=token_loss_temperature, **kwargs)
        if kind == "full":
            outputs = original(*args, **{**kwargs, "use_cache": False})
            labels = token_loss_labels
            loss = (full_loss_sum(outputs.logits, labels, token_loss_shifted, token_loss_dft)
                    if token_loss_per_row is None else full_row_logps(outputs.logits, labels, token_loss_per_row))
        else:
            loss, outputs = chunked_loss_sum(self, token_loss_labels, chunk_tokens, *args, same_calls=calls,
                                             return_outputs=True, per_row=token_loss_per_row,
                                             shifted=token_loss_shifted, dft=token_loss_dft, **kwargs)
        if not token_loss_router_aux:
            return loss
        return loss, router_aux_loss(self, outputs.router_logits, kwargs.get("attention_mask"))

    model.forward = types.MethodType(forward, model)


def has_router(model) -> bool:
    """A mixture-of-experts model whose forward can add the router's load-balancing loss."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return (hasattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func")
            and hasattr(model.config, "output_router_logits"))


def router_aux_loss(model, router_logits, attention_mask=None) -> torch.Tensor:
    """The router's load-balancing loss of a mixture-of-experts model, as its own forward computes
    it (the `load_balancing_loss_func` of the model's transformers module: Switch Transformer's, over
    every layer's router logits, padding left out by the attention mask when there is one)."""
    function = sys.modules[type(model).__module__].load_balancing_loss_func
    return function(router_logits, model.num_experts, model.num_experts_per_tok, attention_mask)


def full_loss_sum(logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False, dft: bool = False) -> torch.Tensor:
    """`shifted`: labels[i] is position i's own target (a sequence-parallel part, `sequence.shard`); `dft`:
    each token's cross-entropy `dft_weighted`."""
    if not shifted:
        logits, labels = logits[:, :-1], labels[:, 1:]
    losses = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE,
                             reduction="none" if dft else "sum")  # 0 where ignored
    return dft_weighted(losses).sum() if dft else losses


def full_row_logps(logits: torch.Tensor, labels: torch.Tensor,
                   sequences: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence (`sequences`: each target position's, as `sequence_index`; None: the rows): the
    sum of its target tokens' log-probabilities, and their count."""
    targets = labels[:, 1:]
    sequences = sequence_index({"labels": labels}) if sequences is None else sequences
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                             reduction="none")  # 0 where ignored
    n = int(sequences.max()) + 1
    kept = targets.flatten() != IGNORE
    return (-losses.new_zeros(n).index_add(0, sequences.flatten(), losses),
            torch.zeros(n, dtype=torch.long, device=labels.device).index_add(0, sequences.flatten()[kept],
                                                                           torch.ones_like(sequences.flatten()[kept])))


def full_token_logps(logits: torch.Tensor, labels: torch.Tensor,
                     temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target token's log-probability and the entropy at it (detached), flat, as `token_logps_each`."""
    targets = labels[:, 1:] != IGNORE
    logps = (logits[:, :-1][targets].float() / temperature).log_softmax(-1)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(-1)
    return logps.gather(-1, labels[:, 1:][targets][:, None])[:, 0], entropy


def full_token_divergences(logits: torch.Tensor, labels: torch.Tensor, teacher_logps: torch.Tensor, beta: float,
                           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target token's divergence to the teacher and the entropy there (detached), flat, as
    `token_divergences`."""
    targets = labels[:, 1:] != IGNORE
    logps = (logits[:, :-1][targets].float() / temperature).log_softmax(-1)
    with torch.no_grad():
        entropy = -(logps.exp() * logps).sum(-1)
    return generalized_jsd(logps, teacher_logps.to(logps.device, torch.float32), beta), entropy


def chunked_loss_sum(model, labels: torch.Tensor, chunk_tokens: int, /, *args, same_calls=None,
                     return_outputs: bool = False, per_row: torch.Tensor | None = None, shifted: bool = False,
                     per_token: bool = False, temperature: float = 1.0, teacher=None, distribution: bool = False,
                     dft: bool = False, **kwargs):
    """The loss sum of a Hugging Face causal LM: backbone, then the output layer on the target
    positions only, `chunk_tokens` at a time, each chunk's logits recomputed in backward.
    `same_calls(module, n, device)`: how often to call the output layer when this rank needs `n`
    calls (the backend's `same_call_count`; None: `n`). `return_outputs`: (the sum, the backbone's
    outputs). `per_row` (each target position's sequence, as `sequence_index`): instead of the sum,
    (each sequence's sum of target log-probabilities, its count of targets), as `full_row_logps`.
    `shifted`: labels[i] is position i's own target (a sequence-parallel part, `sequence.shard`).
    `per_token`: (each target's log-probability, the entropy there, detached), as `token_logps_each`, of
    the logits divided by `temperature`; with `teacher` (the teacher's log-probabilities at the targets, beta), each
    target's divergence to it (`generalized_jsd`) instead of its log-probability. `distribution`: the targets'
    log-probabilities over the whole vocabulary, as `target_distributions` (no gradient). `dft`: the sum of
    each target's cross-entropy `dft_weighted` (Dynamic Fine-Tuning), inside each chunk's checkpoint."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}  # peft passes labels=None, inputs_embeds=None, ...
    outputs = model.get_decoder()(*args, **{**kwargs, "use_cache": False})
    hidden = outputs.last_hidden_state
    if not shifted:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    targets = labels != IGNORE
    rows = per_row[targets] if per_row is not None else None  # each target's sequence, in the selection's order
    hidden, labels = hidden[targets], labels[targets]  # before the output layer: (targets, hidden)
    head = model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)  # Gemma 2 and others

    def chunk_loss(h: torch.Tensor, y: torch.Tensor, t: torch.Tensor | None = None) -> torch.Tensor:
        logits = head(h)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if per_token:
            logps = (logits.float() / temperature).log_softmax(-1)
            entropy = -(logps.exp() * logps).sum(-1).detach()
            if t is not None:
                return generalized_jsd(logps, t.float(), teacher[1]), entropy
            return logps.gather(-1, y[:, None])[:, 0], entropy
        if dft and per_row is None:
            return dft_weighted(F.cross_entropy(logits.float(), y, reduction="none")).sum()
        return F.cross_entropy(logits.float(), y, reduction="sum" if per_row is None else "none")

    # At least one call, so that the output layer takes part in every backward (DDP expects a
    # gradient for every parameter, zero or not); where each call is a collective (ZeRO-3
    # gathers the layer), as many calls on every rank.
    chunks = max(1, math.ceil(len(labels) / chunk_tokens))
    if same_calls is not None:
        chunks = same_calls(head, chunks, hidden.device)
    if distribution:
        out = None
        for i in range(chunks):
            part = slice(i * chunk_tokens, (i + 1) * chunk_tokens)
            logits = head(hidden[part])
            if cap:
                logits = torch.tanh(logits / cap) * cap
            logps = (logits.float() / temperature).log_softmax(-1)
            if out is None:  # filled chunk by chunk: no second copy of the whole
                out = logps.new_empty((len(labels), logps.shape[-1]))
            out[part] = logps
        return out
    if per_token:
        parts = []
        for i in range(chunks):
            part = slice(i * chunk_tokens, (i + 1) * chunk_tokens)
            h, y = hidden[part], labels[part]
            t = teacher[0][part].to(h.device) if teacher is not None else None
            parts.append(checkpoint(chunk_loss, h, y, t, use_reentrant=False) if torch.is_grad_enabled()
                         else chunk_loss(h, y, t))
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    total = hidden.new_zeros((), dtype=torch.float32)
    n = int(per_row.max()) + 1 if per_row is not None else 0
    per_rows = hidden.new_zeros(n, dtype=torch.float32)
    for i in range(chunks):
        h, y = hidden[i * chunk_tokens:(i + 1) * chunk_tokens], labels[i * chunk_tokens:(i + 1) * chunk_tokens]
        losses = checkpoint(chunk_loss, h, y, use_reentrant=False) if torch.is_grad_enabled() else chunk_loss(h, y)
        if per_row is not None:
            per_rows = per_rows.index_add(0, rows[i * chunk_tokens:(i + 1) * chunk_tokens], -losses)
        else:
            total = total + losses
    counts = torch.zeros(n, dtype=torch.long, device=labels.device).index_add(0, rows, torch.ones_like(rows)) \
        if per_row is not None else None
    result = (per_rows, counts) if per_row is not None else total
    return (result, outputs) if return_outputs else result


def check_chunked_loss(model, partitioned: bool = False) -> None:
    """The chunked loss must equal the model's own forward's on a short sequence (on a small copy
    of the architecture where the weights are partitioned: `isolation_probe`). Models that scale
    or cut their logits after the output layer differently from what `chunked_loss_sum` does
    fail here, not silently."""
    from ..model.load import isolation_probe

    probe = isolation_probe(model, partitioned)
    embeddings = probe.get_input_embeddings()  # peft's trainable-token wrapper (added tokens) has no num_embeddings
    vocab = getattr(embeddings, "num_embeddings", None) or probe.config.get_text_config().vocab_size
    device = next(probe.parameters()).device
    # No random numbers drawn (the run's stream stays as it was); eval mode: no dropout either.
    ids = (torch.arange(16, device=device) * 7 + 3).remainder(vocab)[None]
    labels = ids.clone()
    labels[:, :5] = IGNORE
    was_training = probe.training
    probe.eval()
    try:
        with torch.no_grad():
            full = full_loss_sum(type(probe).forward(probe, input_ids=ids, use_cache=False).logits, labels).item()
            chunked = chunked_loss_sum(probe, labels, 4, input_ids=ids).item()
    except Exception as e:  # a model built unlike a causal LM with a backbone and an output layer
        raise ToolkitError(f"train.loss: chunked cannot run on this model ({type(e).__name__}: {e}); "
                           "set train.loss=full") from None
    finally:
        probe.train(was_training)
    rtol = 1e-4 if next(probe.parameters()).dtype == torch.float32 else 2e-2  # a half-precision base: its rounding
    if not abs(chunked - full) <= rtol * abs(full):
        raise ToolkitError(f"train.loss: chunked gives {chunked:.6g} where this model's own forward gives {full:.6g} "
                           "(it does more after its output layer than the chunked loss knows); set train.loss=full")
