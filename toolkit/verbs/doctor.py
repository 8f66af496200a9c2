"""`toolkit doctor`: is this launch healthy, before hours of training depend on it?

Run it the way training runs: `accelerate launch --config_file X.yaml -m toolkit doctor` (or plain
`python -m toolkit doctor`, one process). The main process prints one line per check, `ok` or
`FAIL` with a one-line hint, then a summary; exit 0 when all pass, 1 otherwise. Collectives use
known values and every rank checks its own result; the verdicts are gathered so the failing ranks
are named. Every check runs under a deadline (--timeout): a rank that never answers is a FAIL
line within seconds, never a hang.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import socket
import sys
import threading
import time
from importlib import metadata

import torch
import torch.distributed as dist

from ..backends import deepspeed_config, end_process_group, launch_config
from ..backends.deepspeed_ops import OP_HINTS, needed_ops, op_status
from ..errors import EXIT_CHECK_FAILED, EXIT_OK, ToolkitError

PACKAGES = ("torch", "accelerate", "deepspeed", "transformers", "peft", "datasets")
# Test seams: this rank contributes wrong values to the all-reduce and all-gather / never reaches them.
FAULT_WRONG_RANK, FAULT_HANG_RANK = "TOOLKIT_FAULT_DOCTOR_WRONG_RANK", "TOOLKIT_FAULT_DOCTOR_HANG_RANK"
HINTS = {
    "rendezvous": "every rank must reach MASTER_ADDR:MASTER_PORT (main_process_ip/port): check that every node "
                  "was started, firewalls, and NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME",
    "timeout": "a rank stopped answering: same config and versions on every node? NCCL_SOCKET_IFNAME / "
               "GLOO_SOCKET_IFNAME on an interface the nodes reach each other on, no firewall between them?",
    "wrong": "ranks exchange wrong data: compare versions across nodes; on GPUs retry with NCCL_P2P_DISABLE=1, "
             "then NCCL_IB_DISABLE=1, to find the faulty link",
    "versions": "install the same versions of these packages on every node",
    **OP_HINTS,
}


class Report:
    """Lines on the main process, a tally, and deadlines that turn a hang into a FAIL and an exit."""

    def __init__(self, rank: int, timeout: float):
        self.rank, self.timeout, self.checks, self.failed = rank, timeout, 0, []

    def line(self, ok: bool, name: str, text: str = "", hint: str | None = None) -> None:
        self.checks += 1
        self.failed += [] if ok else [name]
        if self.rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} {name}" + (f": {text}" if text else "") +
                  (f"\n     hint: {hint}" if hint and not ok else ""), flush=True)

    def summary(self, stopped: bool = False) -> int:
        if self.rank == 0:
            print(f"doctor: {len(self.failed)} of {self.checks} checks FAILED ({', '.join(self.failed)})"
                  f"{'; stopped there' if stopped else ''}" if self.failed else
                  f"doctor: all {self.checks} checks passed", flush=True)
        return EXIT_CHECK_FAILED if self.failed else EXIT_OK

    @contextlib.contextmanager
    def deadline(self, name: str, hint: str = "timeout"):
        """Run the block within --timeout; on a hang or an error, FAIL and end this process now
        (after a broken collective neither the process group nor its teardown can be trusted)."""
        timer = threading.Timer(self.timeout, self._abort, (name, f"no answer within {self.timeout:g} s", hint))
        timer.daemon = True
        timer.start()
        try:
            yield
        except Exception as e:
            self._abort(name, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}", hint)
        finally:
            timer.cancel()

    def _abort(self, name: str, text: str, hint: str) -> None:
        self.line(False, name, text, HINTS[hint])
        if self.rank != 0:  # on another node this may be all there is to read
            print(f"rank {self.rank}: FAIL {name}: {text}", file=sys.stderr, flush=True)
        self.summary(stopped=True)
        os._exit(EXIT_CHECK_FAILED)


def versions() -> dict[str, str]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"python": sys.version.split()[0], **{name: version(name) for name in PACKAGES}}


def devices() -> str:
    if not torch.cuda.is_available():
        return f"CPU only ({os.cpu_count()} cores)"
    kinds: dict[str, int] = {}
    for p in map(torch.cuda.get_device_properties, range(torch.cuda.device_count())):
        kind = f"{p.name} ({p.total_memory / 2**30:.0f} GiB)"
        kinds[kind] = kinds.get(kind, 0) + 1
    return ", ".join(f"{n} x {kind}" for kind, n in kinds.items()) + f" on rank 0's node, CUDA {torch.version.cuda}"


def launch() -> tuple[str, dict]:
    """What the accelerate config selects, as the workers see it: (description, zero_optimization)."""
    kind, env = launch_config.launch_kind(os.environ), os.environ
    if kind == "fsdp":
        offload = env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        return f"FSDP{env.get('FSDP_VERSION', '1')}" + (" (offload params to cpu)" if offload else ""), {}
    if kind != "deepspeed":
        return {"ddp": "DDP", "single": "single process"}[kind], {}
    where = deepspeed_config.config_source()
    if where is not None:
        cfg = deepspeed_config.load_json(where)
    else:  # inline deepspeed_config settings in the accelerate YAML
        from accelerate.utils import DeepSpeedPlugin

        cfg, where = DeepSpeedPlugin().deepspeed_config, "the inline deepspeed_config"
    zero = dict(cfg.get("zero_optimization") or {})
    deepspeed_config.normalize_zero(zero, where, [])  # legacy spellings such as cpu_offload
    offload = [f"{part} to {zero[f'offload_{part}'].get('device')}" for part in ("optimizer", "param")
               if (zero.get(f"offload_{part}") or {}).get("device", "none") != "none"]
    sp = launch_config.sequence_parallel_size(env)
    return (f"DeepSpeed ZeRO-{zero.get('stage', 0)}" + (f" (offload {', '.join(offload)})" if offload else "")
            + f" from {where}"
            + (f", each sequence split across {sp} ranks (all-to-all below)" if sp > 1 else "")), zero


def init_group(timeout: float) -> tuple[str, torch.device]:
    cuda = torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "false").lower() != "true"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    kwargs = dict(timeout=datetime.timedelta(seconds=2 * timeout + 10))  # the doctor's deadline comes first
    if "MASTER_ADDR" not in os.environ:  # plain `python -m toolkit doctor`: a group of one
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group("nccl" if cuda else "gloo", **kwargs)
    return dist.get_backend(), device


def gathered(mine):
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def verdict(problem: str | None) -> str:
    """Every rank's own verdict, gathered: the ranks that went wrong, and how ("" when none did)."""
    return "; ".join(f"rank {r} {p}" for r, p in enumerate(gathered(problem)) if p)


def ranks(backend: str, mine: dict) -> tuple[str | None, str]:
    """(ranks whose versions differ from rank 0's, who is where)."""
    seen = gathered((socket.gethostname(), os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_RANK", "0"), mine))
    first = seen[0][3]
    differ = [f"rank {r} has " + ", ".join(f"{k} {v}" for k, v in s[3].items() if first.get(k) != v)
              for r, s in enumerate(seen) if s[3] != first]
    hosts: dict[str, list[str]] = {}
    for r, (host, _, local, _) in enumerate(seen):
        hosts.setdefault(host, []).append(f"{r}/{local}")
    nodes = len({s[1] or s[0] for s in seen})  # torchrun's node rank; the host name without it
    return ("; ".join(differ) + " (rank 0: see versions)" if differ else None,
            f"{backend}, world size {len(seen)}, {nodes} node(s); global/local ranks: "
            + ", ".join(f"{host} {' '.join(rs)}" for host, rs in hosts.items()))


def compare(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> str | None:
    wrong = (got != expected).nonzero()
    if len(wrong) == 0:
        return None
    i = int(wrong[0, 0])
    return f"got {got[i].item():g}{what} at element {i}, expected {expected[i].item():g}"


def known(device, offset: float = 0.0) -> torch.Tensor:
    """Small integers (exact in float32), an odd length so no chunking lines up by luck."""
    return (torch.arange(4099, device=device) % 97).float() + offset


def all_reduce(rank, world, device, fault):
    mine = known(device, rank + fault)
    dist.all_reduce(mine)
    return compare(mine, known(device) * world + world * (world - 1) / 2)


def broadcast(rank, world, device, fault):
    mine = known(device, 1) if rank == 0 else torch.zeros(4099, device=device)
    dist.broadcast(mine, 0)
    return compare(mine, known(device, 1))


def all_gather(rank, world, device, fault):
    parts = [torch.empty(4099, device=device) for _ in range(world)]
    dist.all_gather(parts, known(device, rank + fault))
    return next(filter(None, (compare(p, known(device, r), f" in rank {r}'s part") for r, p in enumerate(parts))), None)


def reduce_scatter(rank, world, device, fault):
    out = torch.empty(4099, device=device)
    dist.reduce_scatter(out, [known(device, rank * world + r) for r in range(world)])  # part r goes to rank r
    return compare(out, known(device) * world + world * world * (world - 1) / 2 + world * rank)


def all_to_all(rank, world, device, fault):
    """Part r of each rank goes to rank r (sequence parallelism's exchange of heads and positions)."""
    out = torch.empty(world * 4099, device=device)
    dist.all_to_all_single(out, torch.cat([known(device, rank * world + r + fault) for r in range(world)]))
    return next(filter(None, (compare(out[r * 4099:(r + 1) * 4099], known(device, r * world + rank),
                                      f" from rank {r}") for r in range(world))), None)


def bandwidth(world: int, device, size_mb: float, runs: int = 5) -> str:
    """algbw = bytes / time; busbw = algbw * 2(n-1)/n, what each link of a ring carries (nccl-tests)."""
    data = torch.ones(max(1, int(size_mb * 2**20) // 4), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(2):  # warmup: connections, buffers
        dist.all_reduce(data)
    sync()
    start = time.perf_counter()
    for _ in range(runs):
        dist.all_reduce(data)
    sync()
    seconds = torch.tensor((time.perf_counter() - start) / runs, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    algbw = data.numel() * 4 / float(seconds) / 1e9
    return (f"all-reduce of {size_mb:g} MB, {runs} runs: {float(seconds) * 1e3:.1f} ms each, "
            f"algbw {algbw:.2f} GB/s, busbw {algbw * 2 * (world - 1) / world:.2f} GB/s")


def gradient_sync(rank, world, device) -> str | None:
    """DDP on this process group, a different batch per rank: every rank must end with the same
    gradients, equal to one process's gradient of all the batches together."""
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(device)
    model = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(reference),
                                                      device_ids=[device.index] if device.type == "cuda" else None)
    batches = [torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + r)).to(device) for r in range(world)]
    model(batches[rank]).square().mean().backward()
    reference(torch.cat(batches)).square().mean().backward()  # equal batches: the mean of the ranks' means
    mine = torch.cat([p.grad.flatten() for p in model.module.parameters()])
    first = mine.clone()
    dist.broadcast(first, 0)
    if not torch.equal(mine, first):
        return f"has gradients up to {float((mine - first).abs().max()):.2e} away from rank 0's"
    error = float((mine - torch.cat([p.grad.flatten() for p in reference.parameters()])).abs().max())
    return f"has gradients {error:.2e} away from the full-batch gradient" if error > 1e-6 else None


def add_arguments(parser) -> None:
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds each check may take (default 60)")
    parser.add_argument("--size-mb", type=float, default=None, help="all-reduce size for the bandwidth "
                        "measurement (default 64 MB on GPUs, 16 MB on CPU)")


def run(args) -> int:
    if args.timeout <= 0 or (args.size_mb is not None and args.size_mb <= 0):
        raise ToolkitError(f"doctor: --timeout and --size-mb must be positive (got {args.timeout:g}, {args.size_mb})")
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    plural = "s" if world > 1 else ""
    report, mine = Report(rank, args.timeout), versions()
    report.line(True, "versions", ", ".join(f"{k} {v}" for k, v in mine.items()))
    report.line(True, "devices", devices())
    description, zero = launch()
    report.line(True, "launch", f"{description}, " + (f"{world} processes, " if world > 1 else "") +
                f"mixed precision {os.environ.get('ACCELERATE_MIXED_PRECISION', 'no')}")
    for op in needed_ops(zero) if rank == 0 else []:  # checked on the main node only
        ok, text, hint = op_status(op)
        report.line(ok, f"deepspeed op {op}", text, hint)
    with report.deadline("rendezvous", "rendezvous"):
        backend, device = init_group(args.timeout)
    with report.deadline("ranks"):
        differ, where = ranks(backend, mine)
        report.line(differ is None, "ranks", differ or where, HINTS["versions"])
    if os.environ.get(FAULT_HANG_RANK) == str(rank):
        time.sleep(3600)  # never reaches the collectives: the others' deadline must end the run
    fault = 100.0 if os.environ.get(FAULT_WRONG_RANK) == str(rank) else 0.0
    for name, check in (("all-reduce (sum)", all_reduce), ("broadcast from rank 0", broadcast),
                        ("all-gather", all_gather), ("reduce-scatter", reduce_scatter), ("all-to-all", all_to_all)):
        with report.deadline(name):
            wrong = verdict(check(rank, world, device, fault))
            report.line(not wrong, f"{name} on {world} rank{plural}", wrong, HINTS["wrong"])
    with report.deadline("bandwidth"):
        size_mb = args.size_mb or (64 if device.type == "cuda" else 16)
        report.line(True, f"bandwidth ({backend})", bandwidth(world, device, size_mb) if world > 1 else
                    "one process, no link to measure")
    with report.deadline("gradient sync"):
        wrong = verdict(gradient_sync(rank, world, device))
        report.line(not wrong, f"gradient sync (DDP, {world} rank{plural})",
                    wrong or "every rank equal to the full-batch gradient (within 1e-6)", HINTS["wrong"])
    code = report.summary()
    with report.deadline("teardown"):
        dist.barrier()  # the summary is out before any rank exits (the launcher stops the rest when one fails)
        end_process_group()
    return code if rank == 0 else 0  # the main process holds every rank's verdict
