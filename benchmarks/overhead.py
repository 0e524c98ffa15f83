"""Per-step overhead of nanguard against a plain loop and common alternatives.

All variants of a model are timed in the same process, interleaved round-robin,
so that drift on a shared machine hits every variant alike. Run
``python benchmarks/overhead.py --help`` for the flags; README.md in this
folder explains the columns.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

# Benchmark the checkout this file lives in, even when nanguard is not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
try:
    import nanguard
    nanguard.init  # noqa: B018  (a half-written package imports but lacks the API)
except Exception as exc:  # report and skip the nanguard variants rather than crash
    nanguard = None
    NANGUARD_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    NANGUARD_IMPORT_ERROR = ""

SEED = 0
LR = 1e-3
MIB = 1024 * 1024


# --------------------------------------------------------------------------- models

class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, n_heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 1024, seq: int = 128, d_model: int = 256,
                 n_heads: int = 4, n_layers: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        # Boolean mask (True = masked) rather than a float -inf mask, so that no
        # tensor in the model legitimately holds an Inf.
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)
        self.register_buffer("causal_mask", mask, persistent=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(self.positions[:t])
        for block in self.blocks:
            x = block(x, self.causal_mask[:t, :t])
        return self.head(self.ln_f(x))


def build_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def build_cnn(n_conv: int = 8, width: int = 32) -> nn.Module:
    layers: list[nn.Module] = []
    in_ch = 3
    for _ in range(n_conv):
        layers += [nn.Conv2d(in_ch, width, 3, padding=1), nn.ReLU()]
        in_ch = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))


def classification_batch(*input_shape: int, classes: int = 10):
    def make(gen: torch.Generator):
        x = torch.randn(*input_shape, generator=gen)
        y = torch.randint(0, classes, (input_shape[0],), generator=gen)
        return x, y
    return make


def token_batch(batch: int = 8, seq: int = 128, vocab: int = 1024):
    def make(gen: torch.Generator):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    return make


def classification_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x), y)


def next_token_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], tuple]
    loss: Callable[..., torch.Tensor]
    steps: int    # steps per variant per round
    rounds: int
    warmup: int   # untimed steps per variant before the first round
    target: float  # acceptable ratio for the default nanguard variant
    micro_batches: int = 1  # gradient accumulation: forwards and backwards per optimizer step
    autocast: torch.dtype | None = None
    clip: float | None = None  # clip_grad_norm_ before every optimizer step (the gradients change after backward)
    variants: tuple[str, ...] | None = None  # None: every variant
    guard: tuple[tuple[str, object], ...] = ()  # nanguard settings of this workload
    extra: str | None = None  # the optional extra its packages come with


WITH_FLOOR = ("plain", "nanguard", "nanguard full", "probe-floor", "sentinel-floor")
"""what a workload beyond the default three runs: nanguard beside the floors of its two modes (per-module
probing for the full mode; the root's hooks, the gradients' norms and one read for the sentinel)"""

# --------------------------------------------------------------- real-model workloads
# Built as the real-model tests build them (tests/realworld/zoo.py), from configs: no downloads.
# They need the ``realworld`` extra; without it they are skipped with a message.

REALWORLD = Path(__file__).resolve().parents[1] / "tests" / "realworld"


def zoo():
    sys.path.insert(0, str(REALWORLD))
    import zoo as module
    return module


def build_hf_gpt2(layers: int = 2) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=64, n_head=2, vocab_size=512, n_positions=64))


def hf_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=x).loss


def build_bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification
    return BertForSequenceClassification(BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        max_position_embeddings=64, num_labels=4))


def bert_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x, labels=y[:, 0] % 4).loss


def build_vit_compiled() -> nn.Module:
    return torch.compile(zoo().vit(), backend="aot_eager")


def build_resnet() -> nn.Module:
    return zoo().resnet()


def build_storm() -> nn.Module:
    """An MLP whose every layer makes NaN: every module bad, every step (on_nan=warn)."""
    model = build_mlp()
    with torch.no_grad():
        for module in model:
            if isinstance(module, nn.Linear):
                module.bias.fill_(math.nan)
    return model


MODELS = {
    spec.name: spec
    for spec in (
        # ~1 ms/step: many steps per round so a round is not dominated by timer noise.
        ModelSpec("mlp", build_mlp, classification_batch(64, 64), classification_loss,
                  steps=50, rounds=20, warmup=30, target=1.10),
        # ~300-500 ms/step on one CPU thread
        ModelSpec("gpt", TinyGPT, token_batch(), next_token_loss,
                  steps=2, rounds=10, warmup=2, target=1.02),
        # ~80-250 ms/step on one CPU thread
        ModelSpec("cnn", build_cnn, classification_batch(32, 3, 32, 32), classification_loss,
                  steps=3, rounds=12, warmup=3, target=1.03),
        # nanoGPT-style: a GPT with 4 micro-batches per optimizer step
        ModelSpec("nanogpt-accum4", lambda: TinyGPT(vocab=256, seq=64, d_model=64, n_heads=2, n_layers=2),
                  token_batch(batch=4, seq=64, vocab=256), next_token_loss, steps=5, rounds=12, warmup=5,
                  target=1.05, micro_batches=4, variants=WITH_FLOOR),
        ModelSpec("hf-gpt2", build_hf_gpt2, token_batch(batch=8, seq=64, vocab=512), hf_lm_loss,
                  steps=10, rounds=12, warmup=5, target=1.05, variants=WITH_FLOOR, extra="realworld"),
        # deep and narrow: per-module costs and anything that grows with depth (a key/value cache
        # handed to every layer) dominate
        ModelSpec("hf-gpt2-24l", lambda: build_hf_gpt2(layers=24), token_batch(batch=4, seq=32, vocab=512),
                  hf_lm_loss, steps=5, rounds=12, warmup=3, target=1.05, variants=WITH_FLOOR,
                  extra="realworld"),
        ModelSpec("bert-bf16", build_bert, token_batch(batch=8, seq=64, vocab=512), bert_loss,
                  steps=10, rounds=12, warmup=5, target=1.03, autocast=torch.bfloat16,
                  variants=WITH_FLOOR, extra="realworld"),
        # no floor: its hook keeps Python state, so it stays out of compiled graphs (it would
        # make Dynamo recompile at every call) and probes nothing there
        ModelSpec("vit-compiled", build_vit_compiled, classification_batch(8, 3, 32, 32), classification_loss,
                  steps=10, rounds=12, warmup=5, target=1.03, variants=("plain", "nanguard", "nanguard full"), extra="realworld"),
        ModelSpec("resnet-bn", build_resnet, classification_batch(8, 3, 32, 32), classification_loss,
                  steps=10, rounds=12, warmup=5, target=1.03, variants=WITH_FLOOR, extra="realworld"),
        # the MLP with clip_grad_norm_ at every step: gradients that change after the backward pass
        # are read again as the optimizer will apply them
        ModelSpec("mlp-clip", build_mlp, classification_batch(64, 64), classification_loss,
                  steps=50, rounds=20, warmup=30, target=1.10, variants=WITH_FLOOR, clip=1.0),
        ModelSpec("nan-storm", build_storm, classification_batch(64, 64), classification_loss,
                  steps=50, rounds=12, warmup=10, target=1.5, variants=("plain", "nanguard", "nanguard full"),
                  guard=(("on_nan", "warn"), ("max_events", 64))),
    )
}
QUICK = {"mlp": (10, 3, 5), "gpt": (1, 3, 1), "cnn": (1, 3, 1)}  # steps, rounds, warmup
DEFAULT_MODELS = ("mlp", "gpt", "cnn")  # what `make bench` runs; the others by name (--models)


# ------------------------------------------------------------------------- variants

Detach = Callable[[], None]


def attach_nothing(model: nn.Module, opt: torch.optim.Optimizer, **workload) -> Detach:
    return lambda: None


def attach_nanguard(**overrides) -> Callable[..., Detach]:
    def attach(model: nn.Module, opt: torch.optim.Optimizer, **workload) -> Detach:
        return nanguard.init(model, opt, **(workload | overrides)).close
    return attach


class Places:
    """Places made in advance, one buffer per (dtype, device), that a floor writes the extremes of
    floating tensors into, as nanguard's probes do, and reads once per optimizer step."""

    SIZE = 1 << 14

    def __init__(self):
        self._places: dict[tuple[torch.dtype, torch.device], list] = {}  # [buffer, its 0-d views, used]

    def extremes(self, tensor: torch.Tensor) -> None:
        if not tensor.is_floating_point() or not tensor.numel():
            return
        key = (tensor.dtype, tensor.device)
        if key not in self._places:
            with torch.inference_mode(False), torch.no_grad():
                buffer = torch.empty(self.SIZE, dtype=tensor.dtype, device=tensor.device)
            self._places[key] = [buffer, buffer.unbind(), 0]
        entry = self._places[key]
        used = entry[2] % self.SIZE
        entry[2] = used + 2
        with torch.no_grad():
            torch.aminmax(tensor, out=(entry[1][used], entry[1][used + 1]))

    def read(self, more: list[torch.Tensor] = ()) -> None:
        """The one device-to-host read of the step: what was written, and ``more`` (0-d tensors)."""
        pieces = [entry[0][:min(entry[2], self.SIZE)].float() for entry in self._places.values() if entry[2]]
        if more:
            pieces.append(torch.stack(more).float())
        if pieces:
            torch.cat(pieces).tolist()
        for entry in self._places.values():
            entry[2] = 0


def attach_probe_floor(model: nn.Module, opt: torch.optim.Optimizer, **workload) -> Detach:
    """The floor of per-module probing: a forward hook on every module (plain ``nn.Sequential``
    left out, as nanguard does) that writes its output's minimum and maximum into places made in
    advance, as nanguard's probe does, and one read of them per optimizer step. No identity
    tracking, inputs, gradients, buffers, RNG or decision: what is left of nanguard's cost when
    everything but the probes is taken away."""
    places = Places()

    def hook(module: nn.Module, args, output) -> None:
        if torch.compiler.is_compiling():
            return  # its Python state would make Dynamo recompile at every call: not a floor there
        if type(output) is torch.Tensor:
            places.extremes(output)

    def read(optimizer, args, kwargs) -> None:
        places.read()

    handles = [m.register_forward_hook(hook) for m in model.modules() if type(m) is not nn.Sequential]
    handles.append(opt.register_step_pre_hook(read))
    return lambda: [h.remove() for h in handles]


def sentinel_floor(norms: bool = True) -> Callable[..., Detach]:
    """The floor of the sentinel's design: what a clean sentinel step cannot do without, and nothing
    else. The root's forward pre-hook (with keyword arguments, as a model called by keyword needs)
    clones torch's CPU random state (what a re-run restores); its forward hook (always called) writes
    the extremes of each floating output into places made in advance and puts a pre-hook on the first
    one's autograd node, which queues a callback for the end of the backward pass: there the
    gradients' norms, from one fused pass (what the spike warning and the flight recorder read); the
    optimizer's step pre-hook writes the norms after the extremes and reads them once. No batch
    references, versions, buffers, accumulation bookkeeping, decision nor flight recorder: what is
    left of the sentinel's cost when its bookkeeping is taken away. ``norms=False``: without the norms
    (a floor without the spike warning and the flight recorder's gradient norms)."""
    def attach(model: nn.Module, opt: torch.optim.Optimizer, **workload) -> Detach:
        return _attach_sentinel_floor(model, opt, norms)
    return attach


def _attach_sentinel_floor(model: nn.Module, opt: torch.optim.Optimizer, norms_too: bool) -> Detach:
    params = [p for p in model.parameters() if p.requires_grad]
    places = Places()
    state = {"norms": [], "queued": False, "rng": None}
    engine = torch.autograd.Variable._execution_engine

    def ended() -> None:
        state["queued"] = False
        grads = [p.grad for p in params if p.grad is not None] if norms_too else []
        with torch.no_grad():
            state["norms"] = torch._foreach_norm(grads) if grads else []

    def started(grad) -> None:
        if not state["queued"]:
            engine.queue_callback(ended)
            state["queued"] = True

    def pre(module, args, kwargs) -> None:
        if not torch.compiler.is_compiling():
            state["rng"] = torch.default_generator.clone_state()

    def post(module, args, kwargs, output) -> None:
        if torch.compiler.is_compiling():
            return
        outputs = _tensors(output)
        for tensor in outputs:
            places.extremes(tensor)
        node = next((t.grad_fn for t in outputs if t.grad_fn is not None), None)
        if node is not None:
            node.register_prehook(started)

    def read(optimizer, args, kwargs) -> None:
        places.read(state["norms"])
        state["norms"] = []

    handles = [model.register_forward_pre_hook(pre, with_kwargs=True),
               model.register_forward_hook(post, with_kwargs=True, always_call=True),
               opt.register_step_pre_hook(read)]
    return lambda: [h.remove() for h in handles]


def _tensors(output: object) -> list[torch.Tensor]:
    """The tensors of a root's output: itself, or those of one level of a tuple, list or dict."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [t for t in items if isinstance(t, torch.Tensor)]


def attach_naive_hooks(model: nn.Module, opt: torch.optim.Optimizer, **workload) -> Detach:
    """Forward hooks as tutorials write them: one blocking check per module output."""
    def check(module: nn.Module, inputs, output) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        for t in outputs:
            if isinstance(t, torch.Tensor) and (torch.isnan(t).any() or torch.isinf(t).any()):
                raise RuntimeError(f"NaN/Inf in output of {type(module).__name__}")

    handles = [m.register_forward_hook(check) for m in model.modules()]
    return lambda: [h.remove() for h in handles]


def anomaly_mode() -> ContextManager:
    return torch.autograd.detect_anomaly(check_nan=True)


@dataclass(frozen=True)
class Variant:
    name: str
    attach: Callable[[nn.Module, torch.optim.Optimizer], Detach] = attach_nothing
    step_context: Callable[[], ContextManager] = contextlib.nullcontext
    needs_nanguard: bool = False


VARIANTS = {
    v.name: v
    for v in (
        Variant("plain"),
        Variant("nanguard", attach_nanguard(), needs_nanguard=True),  # the default mode: the sentinel
        Variant("nanguard full", attach_nanguard(mode="full"), needs_nanguard=True),
        Variant("nanguard+param-grads", attach_nanguard(param_grad_norms=True),
                needs_nanguard=True),
        Variant("nanguard detail_mb=0", attach_nanguard(detail_mb=0), needs_nanguard=True),
        Variant("nanguard capture=False", attach_nanguard(capture=False), needs_nanguard=True),
        Variant("detect_anomaly", step_context=anomaly_mode),
        Variant("naive-hooks", attach_naive_hooks),
        Variant("probe-floor", attach_probe_floor),
        Variant("sentinel-floor", sentinel_floor()),
        Variant("sentinel-floor without norms", sentinel_floor(norms=False)),
    )
}
TARGET_VARIANT = "nanguard"
FLOOR_VARIANT = "probe-floor"
FLOORS = {"nanguard": "sentinel-floor"}
"""the floor each variant is measured over, where not ``FLOOR_VARIANT``: the sentinel's own design"""


# --------------------------------------------------------------------------- timing

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """One model + optimizer + fixed batches (one per micro-batch, as a loop feeds each its own) with a
    variant attached."""

    def __init__(self, spec: ModelSpec, variant: Variant, device: torch.device):
        torch.manual_seed(SEED)
        self.model = spec.build().to(device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)
        gen = torch.Generator().manual_seed(SEED + 1)
        self.batches = [tuple(t.to(device) for t in spec.make_batch(gen)) for _ in range(spec.micro_batches)]
        self.loss = spec.loss
        self.spec = spec
        self.variant = variant
        self.device = device
        self.detach = variant.attach(self.model, self.opt, **dict(spec.guard))

    def step(self) -> None:
        spec = self.spec
        with self.variant.step_context():
            for batch in self.batches:
                with torch.autocast(self.device.type, dtype=spec.autocast, enabled=spec.autocast is not None):
                    loss = self.loss(self.model, *batch)
                (loss / spec.micro_batches).backward()
            if spec.clip is not None:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), spec.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def timed_steps(self, n: int) -> list[float]:
        """Seconds per step for n consecutive steps."""
        gc.collect()
        times = []
        for _ in range(n):
            synchronize(self.device)
            start = time.perf_counter()
            self.step()
            synchronize(self.device)
            times.append(time.perf_counter() - start)
        return times

    def close(self) -> None:
        self.detach()


@dataclass
class Result:
    model: str
    variant: str
    samples_ms: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)  # per-round median
    ms_per_step: float = float("nan")
    ratio: float = float("nan")
    paired_ratio: float = float("nan")
    paired_ratios: list[float] = field(default_factory=list)
    over_floor: float = float("nan")  # median over rounds of (variant / its floor: FLOORS), where the floor ran


def benchmark_model(spec: ModelSpec, variants: list[Variant], device: torch.device,
                    steps: int, rounds: int, warmup: int) -> list[Result]:
    runners: list[Runner] = []
    results = [Result(spec.name, v.name) for v in variants]
    try:
        for v in variants:
            runners.append(Runner(spec, v, device))
            runners[-1].timed_steps(warmup)
        for r in range(rounds):
            # Rotate the order so that no variant always runs right after another.
            order = [(i + r) % len(runners) for i in range(len(runners))]
            for i in order:
                ms = [t * 1e3 for t in runners[i].timed_steps(steps)]
                results[i].samples_ms += ms
                results[i].round_ms.append(statistics.median(ms))
            if sys.stderr.isatty():
                print(f"  {spec.name}: round {r + 1}/{rounds}", end="\r", file=sys.stderr, flush=True)
        if sys.stderr.isatty():
            print(" " * 40, end="\r", file=sys.stderr, flush=True)
    finally:
        for runner in runners:
            runner.close()

    plain = next(res for res in results if res.variant == "plain")
    for res in results:
        res.ms_per_step = statistics.median(res.samples_ms)
        res.ratio = res.ms_per_step / statistics.median(plain.samples_ms)
        res.paired_ratios = [v / p for v, p in zip(res.round_ms, plain.round_ms)]
        res.paired_ratio = statistics.median(res.paired_ratios)
    by_name = {res.variant: res for res in results}
    for res in results:
        floor = by_name.get(FLOORS.get(res.variant, FLOOR_VARIANT))
        if floor is not None and res.variant != "plain" and not res.variant.endswith("-floor"):
            res.over_floor = statistics.median(v / f for v, f in zip(res.round_ms, floor.round_ms))
    return results


# --------------------------------------------------------------------------- memory

MEM_VARIANTS = ("plain", "nanguard")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0). False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def mem_probe(model: str, variant: str, device: torch.device, warmup: int, steps: int) -> dict:
    """Peak memory of `steps` training steps after `warmup` steps, in this process.

    Warm-up steps come first so that gradients and any buffers a variant keeps
    between steps already exist; the peak then covers persistent plus transient
    memory of a steady-state step.
    """
    runner = Runner(MODELS[model], VARIANTS[variant], device)
    runner.timed_steps(warmup)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        runner.timed_steps(steps)
        peak, kind = torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    else:
        exact = reset_peak_rss()
        base = current_rss_bytes() if exact else 0
        runner.timed_steps(steps)
        peak = peak_rss_bytes()
        kind = "VmHWM (reset after warm-up)" if exact else "ru_maxrss (process lifetime)"
    runner.close()
    return {"peak_mib": peak / MIB, "step_growth_mib": (peak - base) / MIB if base else None,
            "measure": kind}


def run_mem_probe_subprocess(model: str, variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--mem-probe", model, variant,
           "--threads", str(args.threads), "--device", args.device]
    if args.quick:
        cmd.append("--quick")
    # glibc raises its mmap threshold as large blocks are freed, so whether a tensor's
    # memory goes back to the OS varies from run to run; a fixed threshold makes the
    # peak RSS repeatable to about 1 MiB instead of tens of MiB.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:  # report it, keep the timings
        return {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_memory(models: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Run every probe in its own process; they run after the timings, so in parallel."""
    variants = [v for v in MEM_VARIANTS if nanguard is not None or not VARIANTS[v].needs_nanguard]
    jobs = [(m, v) for m in models for v in variants]
    workers = min(len(jobs), os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        probes = dict(zip(jobs, pool.map(lambda job: run_mem_probe_subprocess(*job, args), jobs)))
    memory = {}
    for m in models:
        memory[m] = {v: probes[m, v] for v in variants}
        print_memory(m, memory[m], args.device)
    return memory


def print_memory(model: str, mem: dict, device: str) -> None:
    failed = {v: m["error"] for v, m in mem.items() if "error" in m}
    if failed:
        print(f"  {model}: memory probe failed: {failed}")
        return
    unit = "CUDA peak allocated" if device == "cuda" else "peak RSS"
    if "nanguard" in mem:
        p, g = mem["plain"]["peak_mib"], mem["nanguard"]["peak_mib"]
        line = f"{unit} plain {p:.1f} MiB, nanguard {g:.1f} MiB, added {g - p:+.1f} MiB"
    else:
        line = f"{unit} plain {mem['plain']['peak_mib']:.1f} MiB (nanguard unavailable)"
    growth = {v: m["step_growth_mib"] for v, m in mem.items() if m["step_growth_mib"] is not None}
    if growth:
        line += " | growth during steps: " + ", ".join(f"{v} {g:+.1f} MiB" for v, g in growth.items())
    print(f"  {model}: {line}  [{mem['plain']['measure']}]")


# --------------------------------------------------------------------------- report

def target_cell(spec: ModelSpec, res: Result) -> str:
    if res.variant != TARGET_VARIANT:
        return ""
    verdict = "ok" if res.paired_ratio <= spec.target else "over"
    return f"<= {spec.target:.2f}: {verdict}"


def spread(ratios: list[float]) -> str:
    """The middle 80% of the per-round paired ratios (min-max with fewer than 10 rounds)."""
    ordered = sorted(ratios)
    if not ordered:
        return ""
    cut = len(ordered) // 10
    return f"{ordered[cut]:.3f}-{ordered[len(ordered) - 1 - cut]:.3f}"


def print_table(results: list[Result]) -> None:
    print("| model | variant | ms/step | ratio | paired ratio | paired spread | over the floor | target |")
    print("|---|---|---:|---:|---:|---|---:|---|")
    for res in results:
        over = "" if math.isnan(res.over_floor) else f"{res.over_floor:.3f}"
        print(f"| {res.model} | {res.variant} | {res.ms_per_step:.3f} | {res.ratio:.3f} "
              f"| {res.paired_ratio:.3f} | {spread(res.paired_ratios)} | {over} | {target_cell(MODELS[res.model], res)} |")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="comma-separated subset of: " + ", ".join(MODELS) + " (default: "
                        + ", ".join(DEFAULT_MODELS) + "; the others need the realworld extra where marked)")
    p.add_argument("--rounds", type=positive_int, help="rounds per model (default: per model)")
    p.add_argument("--steps", type=positive_int, help="steps per variant per round (default: per model)")
    p.add_argument("--warmup", type=int, help="untimed steps per variant (default: per model)")
    p.add_argument("--quick", action="store_true", help="few rounds; a smoke test")
    p.add_argument("--threads", type=positive_int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--no-mem", action="store_true", help="skip the peak-memory probes")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--mem-probe", nargs=2, metavar=("MODEL", "VARIANT"),
                   help=argparse.SUPPRESS)  # internal: one memory probe, prints JSON
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but torch.cuda.is_available() is False")
    return args


def schedule(spec: ModelSpec, args: argparse.Namespace) -> tuple[int, int, int]:
    steps, rounds, warmup = QUICK.get(spec.name, (1, 3, 1)) if args.quick else (spec.steps, spec.rounds, spec.warmup)
    return args.steps or steps, args.rounds or rounds, args.warmup if args.warmup is not None else warmup


def measure_capture_bookkeeping(results: list[Result], calls: int = 2000) -> dict[str, float]:
    """What keeping a step's capture material costs on a clean step, against each plain step.

    The batch is held by reference (no copy), so the whole per-step cost is the RNG snapshot
    taken when a step begins. Timed directly (median of ``calls``), because a difference of
    microseconds on a step of hundreds of milliseconds drowns in the noise of a ratio.
    """
    from nanguard import incident as capture

    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        capture.rng_snapshot(host=False)
        samples.append(time.perf_counter() - start)
    cost_ms = statistics.median(samples) * 1e3
    out = {"rng_snapshot_ms": cost_ms}
    print(f"\ncapture bookkeeping per clean step (RNG snapshot, batch held by reference): "
          f"{cost_ms * 1e3:.1f} us")
    for res in results:
        if res.variant == "plain":
            share = cost_ms / res.ms_per_step
            out[res.model] = share
            print(f"  {res.model}: {100 * share:.3f}% of the plain step"
                  + ("  (target <= 1%: " + ("ok)" if share <= 0.01 else "MISSED)") if res.model == "gpt" else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    # Move the objects of torch's import out of the collector's reach, so the
    # gc.collect() before each timed block is cheap and collections inside it are rare.
    gc.collect()
    gc.freeze()
    device = torch.device(args.device)
    # detect_anomaly warns every time it is entered.
    warnings.filterwarnings("ignore", message=".*[Aa]nomaly [Dd]etection.*")

    if args.mem_probe:
        model, variant = args.mem_probe
        warmup, steps = (1, 2) if args.quick else (3, 10)
        print(json.dumps(mem_probe(model, variant, device, warmup, steps)))
        return 0

    variants = list(VARIANTS.values())
    if nanguard is None:
        print(f"nanguard is not importable ({NANGUARD_IMPORT_ERROR}); skipping variants: "
              + ", ".join(v.name for v in variants if v.needs_nanguard))
        variants = [v for v in variants if not v.needs_nanguard]

    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"python {platform.python_version()}, {platform.machine()}")
    results: list[Result] = []
    memory: dict[str, dict] = {}
    config: dict[str, dict] = {}
    for name in args.models:
        spec = MODELS[name]
        steps, rounds, warmup = schedule(spec, args)
        try:
            spec.build()
        except ImportError as exc:
            print(f"{name}: skipped, {exc} (pip install -c constraints.txt -e '.[{spec.extra}]')")
            continue
        config[name] = {"steps": steps, "rounds": rounds, "warmup": warmup}
        print(f"{name}: {rounds} rounds x {steps} steps per variant, {warmup} warm-up steps"
              + (f", {spec.micro_batches} micro-batches a step" if spec.micro_batches > 1 else ""))
        chosen = [v for v in variants if spec.variants is None or v.name in spec.variants]
        model_results = benchmark_model(spec, chosen, device, steps, rounds, warmup)
        results += model_results
        print_table(model_results)
    if not args.no_mem:
        # Each probe process spends ~6 s importing torch and torch._dynamo (pulled in by
        # the optimizer); a smoke test probes one model, which runs the same code path.
        mem_models = args.models[:1] if args.quick else args.models
        print("peak memory (fresh subprocess per model and variant"
              + (f"; --quick: {mem_models[0]} only):" if args.quick else "):"))
        memory = measure_memory(mem_models, args)

    print("\nRatios are against 'plain' measured in the same run; 'paired ratio' is the median "
          "over rounds of (variant / plain) within each round; targets are checked on it.\n")
    print_table(results)
    capture_cost = measure_capture_bookkeeping(results) if nanguard is not None else {}

    if args.json:
        payload = {
            "torch": torch.__version__, "device": args.device, "threads": args.threads,
            "nanguard_available": nanguard is not None, "config": config,
            "results": [vars(r) for r in results], "memory": memory, "capture": capture_cost,
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
