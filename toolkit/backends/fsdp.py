"""FSDP (1 and 2, from the accelerate YAML's fsdp_* keys): parameters, gradients and optimizer
state sharded across ranks; a wrapped module unshards its parameters inside its own forward."""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from ..errors import ToolkitError
from ..storage.verify import blank_like, read_back, tree_mismatch
from .base import Backend, HostCopies


def _fsdp_classes():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    return FSDPModule, FSDP1


class FSDP(Backend):
    def accelerator_options(self, recipe, notes) -> dict:
        if not self.cuda:
            # Both only matter when ranks load different weights onto a GPU; here they query one and fail.
            os.environ["FSDP_SYNC_MODULE_STATES"] = os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
        return {}

    def after_accelerator(self) -> None:
        if self.accelerator.state.distributed_type.name != "FSDP":
            self.force_on_cpu()

    def force_on_cpu(self) -> None:
        """accelerate never selects FSDP on a CPU host; FSDP2 itself runs on gloo."""
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, OffloadPolicy

        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* settings the launcher exported
        # Offload copies parameters to the accelerator for compute and fails without one ("Cannot
        # access accelerator device"); on a CPU-only host they are in CPU memory anyway (said in
        # launch_config.check).
        if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
            plugin.cpu_offload = OffloadPolicy()
        elif isinstance(plugin.cpu_offload, CPUOffload) and plugin.cpu_offload.offload_params:
            plugin.cpu_offload = CPUOffload(offload_params=False)
        state = self.accelerator.state
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        # Every later AcceleratorState() copies PartialState's fields over its own (accelerate does
        # that inside prepare and save_state), which turned this back into MULTI_CPU: checkpoints then
        # took the unsharded path and failed. So PartialState says FSDP too.
        PartialState().distributed_type = DistributedType.FSDP

    @property
    def plugin(self):
        return self.accelerator.state.fsdp_plugin

    @contextmanager
    def sampling(self, model, gather: bool = True):
        """Every FSDP module unsharded once and kept whole across the sampling's forwards (FSDP2
        otherwise gathers each layer in each token's forward and frees it after), then resharded
        and its reshard-after-forward setting put back as it was. Without `gather`
        (rl.gather_for_sampling false) every module, the root too, resharded after each forward instead, so
        no rank holds more than a layer beyond its shards; every rank steps together (`sample`'s `synced`).
        FSDP1: its own forward, a unit at a time, either way."""
        from torch.distributed.fsdp import FSDPModule

        module = self.accelerator.unwrap_model(model)
        sharded = [m for m in module.modules() if isinstance(m, FSDPModule)]
        # FSDP2 keeps the setting per parameter group (the root's differs from the layers'): saved
        # as it is, since set_reshard_after_forward(True) would not give the root's back.
        saved = [(m._get_fsdp_state(), [(g, g.post_forward_mesh_info) for g in m._get_fsdp_state()._fsdp_param_groups])
                 for m in sharded]
        autos = [state._auto_reshard_after_forward for state, _ in saved]
        for m in sharded:
            m.set_reshard_after_forward(not gather, recurse=False)
            if gather:
                m.unshard()
        try:
            yield module
        finally:
            for m in sharded:
                m.reshard()
            for (state, groups), auto in zip(saved, autos):
                state._auto_reshard_after_forward = auto
                for group, info in groups:
                    group.post_forward_mesh_info = info

    def prepare_frozen(self, model):
        """FSDP2: sharded as the trained model (the plugin's wrapping, mixed precision and offload), as TRL's
        prepare_model(evaluation_mode=True) does, and every module resharded after its forward (FSDP2 keeps the
        root's, and shard-grad-op every module's, parameters whole after a forward until a backward that a
        frozen model never runs); FSDP1: a whole copy on every rank."""
        if self.plugin.fsdp_version != 2:
            return super().prepare_frozen(model)
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model
        from torch.distributed.fsdp import FSDPModule

        model.requires_grad_(False)
        model = fsdp2_prepare_model(self.accelerator, model)  # fully_shard moves only this rank's shards
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_reshard_after_forward(True, recurse=False)
        return model.eval()

    def frozen_line(self) -> str:
        return "sharded across the ranks (FSDP2)" if self.plugin.fsdp_version == 2 else "a whole copy on every rank"

    def sampling_line(self, gather: bool = True) -> str:
        if self.plugin.fsdp_version != 2:
            return "FSDP1's own forward (online RL is tested on FSDP2 only)"
        return ("whole weights gathered once per sampling (FSDP modules unsharded for it)" if gather else
                "sharded weights, each layer gathered in each token's forward (FSDP2, rl.gather_for_sampling false)")

    def check_prepared(self, model) -> None:
        FSDPModule, FSDP1 = _fsdp_classes()
        if not (isinstance(model, (FSDPModule, FSDP1)) or any(isinstance(m, FSDPModule) for m in model.modules())):
            raise ToolkitError("launch: FSDP was configured but the model was not wrapped by FSDP")

    def layout(self) -> str:
        plugin = self.plugin
        kind_of_state = getattr(plugin.state_dict_type, "name", plugin.state_dict_type)
        return f"FSDP{getattr(plugin, 'fsdp_version', 1)} {kind_of_state}"

    def call_is_collective(self, module) -> bool:
        return any(isinstance(m, _fsdp_classes()) for m in module.modules())

    def trainable_weights(self, model, dtype: torch.dtype | None = None) -> dict:
        if self.plugin.fsdp_version != 2:  # FSDP1 keeps flat parameters under wrapped names
            raise ToolkitError("rl.sampler: vllm needs FSDP2 (fsdp_version: 2) or DeepSpeed to gather the weights; "
                               "FSDP1 is not supported")
        module = self.accelerator.unwrap_model(model)
        out, main = HostCopies(dtype), self.accelerator.is_main_process
        for n, p in module.named_parameters():  # every rank gathers each shard, in the same order
            if p.requires_grad:
                whole = p.full_tensor() if hasattr(p, "full_tensor") else p
                if main:  # the host copy on the main process only
                    out.take(n, whole)
                del whole
        return out.done()

    def full_state_dict(self, model) -> dict:
        state_dict = super().full_state_dict(model)
        # A sharded state-dict type hands back DTensor shards: gather each (all ranks, same order).
        return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict.items()}

    def frozen_left_out(self, model):
        """FSDP2 saves and loads through torch.distributed.checkpoint's state-dict API, which reads
        the model's own state dict: the frozen weights are left out as elsewhere. FSDP1's state dict
        passes through FSDP's own hooks and flat parameters; its checkpoints still hold the whole
        model (it cannot run on a CPU-only host, where this is tested)."""
        return super().frozen_left_out(model) if self.plugin.fsdp_version == 2 else nullcontext()

    def saved_state_problem(self, model, optimizer, folder: Path) -> str | None:
        """The state dicts accelerate saved, rebuilt from the live model the way it built them; a
        sharded checkpoint is loaded (torch.distributed.checkpoint) into empty copies of this rank's
        shards, a full one compared on the main process."""
        import torch.distributed.checkpoint as dcp
        from accelerate.utils.fsdp_utils import _get_model_state_dict, _prepare_sd_options  # what save_state uses
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
        from torch.distributed.fsdp import StateDictType

        plugin = self.plugin
        options = _prepare_sd_options(plugin)
        ctx = (FSDP1.state_dict_type(model, plugin.state_dict_type, plugin.state_dict_config,
                                     plugin.optim_state_dict_config)
               if plugin.fsdp_version == 1 else nullcontext())
        with ctx, self.frozen_left_out(model):
            weights = _get_model_state_dict(model, sd_options=options)
            if plugin.fsdp_version == 2:
                from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

                optim = get_optimizer_state_dict(model, optimizer, options=options)
            else:
                optim = FSDP1.optim_state_dict(model, optimizer)
        if plugin.state_dict_type == StateDictType.FULL_STATE_DICT:
            if self.accelerator.process_index != 0:
                return None
            return (tree_mismatch(read_back(folder / "pytorch_model_fsdp.bin"), weights, "pytorch_model_fsdp.bin")
                    or tree_mismatch(read_back(folder / "optimizer.bin"), optim, "optimizer.bin"))
        problems = []
        for key, live, sub in (("model", weights, "pytorch_model_fsdp_0"), ("optimizer", optim, "optimizer_0")):
            scratch = {key: blank_like(live)}
            dcp.load(scratch, checkpoint_id=str(folder / sub))
            problems.append(tree_mismatch(scratch[key], live, sub))
        return next((p for p in problems if p), None)
