"""Held-out loss of a small Llama trained by each optimizer arm from one initialisation on
one data order: does bf16 forge learn like fp32-master AdamW, where plain bf16 AdamW stalls?

    python benchmarks/convergence.py --lr 3e-5 --out conv_3e-5.json --png conv_3e-5.png
    python benchmarks/convergence.py --quantization-report --jobs 13 --out conv.json --png conv.png --md conv.md
    python benchmarks/convergence.py --lr 1e-3 --arms fp32_master,forge_int8,forge_al8 --out conv_1e-3.json
    python benchmarks/convergence.py --curves conv_3e-5.json conv_1e-3.json --png convergence.png --md convergence.md
    python benchmarks/convergence.py --steps 20 --hidden 64 --layers 2 --vocab 512 --seq 32 --batch 4 --device cpu

Arms (weights / optimizer): fp32_master (fp32 + bf16 autocast + torch fused AdamW, the
reference), bf16_adamw (bf16 + torch fused AdamW), forge_bf16_sr and forge_bf16_nearest
(bf16 + forge, bf16 state, stochastic / nearest rounding), forge_int8, forge_al8, forge_log4,
forge_log4_factored (log4 m, factored v).
Every arm uses AdamW (betas 0.9/0.999, eps 1e-8, --weight-decay on all but norms and biases), a cosine
schedule to 0 after a linear warm-up, forge_hf.causal_lm_loss, and on CUDA forge's arms step
through forge_hf.GraphedStep (torch's arms are eager: the step time is not the comparison here).

Data: ``TopicMarkovLanguage``, a synthetic language drawn with a fixed seed. Each document
has a hidden topic; each token follows the previous one through a sparse global transition
row or a sparse row of the document's topic. A model learns a unigram, then the global
bigrams, then ~``topics * vocab * 4`` topic bigrams, many in rows it meets rarely, while it
must infer the topic from the evidence spread over the document so far. The floor is
exact: the true source's loss on the held-out set (Bayes over the topic), in the JSON and
on the plot.

--quantization-report: one more arm, forge_fp32 (bf16 weights, fp32 state), whose AdamW
moments are read at the --capture-steps; each step's gradient is recovered from two
consecutive first moments, and forge_hf.quantization_report measures on every fused layer
how bf16, int8, al8, log4 and log4_factored storage of those real states would change that
step's update (E_upd).

Each (arm, lr) is a row of the results table (final_eval_loss in the note); --out holds the
curves (rewritten after each arm, so a run cut short keeps the arms it finished). With
--jobs, each process's curves go to <out stem>_parts/ beside --out, kept if the run is cut
short: draw what finished with --curves.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from results_table import add_table_option, append_rows

BETAS, EPS = (0.9, 0.999), 1e-8


@dataclass(frozen=True)
class Arm:
    dtype: torch.dtype  # the weights'
    state_precision: str | None  # forge's; None: torch.optim.AdamW(fused=True)
    rounding: str = "stochastic"
    autocast: bool = False  # bf16 autocast around the forward


ARMS = {
    "fp32_master": Arm(torch.float32, None, autocast=True),
    "bf16_adamw": Arm(torch.bfloat16, None),
    "forge_bf16_sr": Arm(torch.bfloat16, "bf16", "stochastic"),
    "forge_bf16_nearest": Arm(torch.bfloat16, "bf16", "nearest"),
    "forge_int8": Arm(torch.bfloat16, "int8"),
    "forge_al8": Arm(torch.bfloat16, "al8"),
    "forge_log4": Arm(torch.bfloat16, "log4"),
    "forge_log4_factored": Arm(torch.bfloat16, "log4_factored"),
}
REFERENCE = "fp32_master"
CAPTURE_ARM = "forge_fp32"  # --quantization-report's: fp32 moments, nothing rounded away yet
ALL_ARMS = {**ARMS, CAPTURE_ARM: Arm(torch.bfloat16, "fp32")}
REPORT_PRECISIONS = ("bf16", "int8", "al8", "log4", "log4_factored")


# ------------------------------------------------------------------------------ the data


class TopicMarkovLanguage:
    """Documents of a topic mixture of sparse Markov chains over ``vocab`` tokens.

    A document draws a topic k uniformly, its first token from topic k's unigram (Zipf over
    the vocabulary permuted for k), then each next token b after a: with probability
    1 - TOPIC_WEIGHT from a's global row (GLOBAL_SUCCESSORS tokens drawn from the unpermuted
    Zipf, Dirichlet(1) weights), else from a's row of topic k (TOPIC_SUCCESSORS tokens from
    topic k's Zipf). Everything follows from ``seed``, on the CPU, so every machine draws
    the same documents."""

    GLOBAL_SUCCESSORS, TOPIC_SUCCESSORS, TOPIC_WEIGHT, ZIPF = 16, 4, 0.5, 1.1

    def __init__(self, vocab: int = 4096, topics: int = 32, seed: int = 0):
        self.vocab, self.topics, self.seed = vocab, topics, seed
        g = torch.Generator().manual_seed(seed)
        zipf = torch.arange(1, vocab + 1, dtype=torch.float64) ** -self.ZIPF
        self.zipf_cdf = zipf_cdf = (zipf / zipf.sum()).cumsum(0)
        self.perms = torch.stack([torch.randperm(vocab, generator=g) for _ in range(topics)])  # (K, V): rank -> token
        self.topic_unigram = torch.zeros(topics, vocab, dtype=torch.float64)
        self.topic_unigram.scatter_(1, self.perms, (zipf / zipf.sum()).expand(topics, -1))

        def zipf_draw(*shape):  # token ranks, Zipf-distributed
            u = torch.rand(shape, generator=g, dtype=torch.float64)
            return torch.searchsorted(zipf_cdf, u).clamp_max(vocab - 1)

        def dirichlet(*shape):
            e = -torch.rand(shape, generator=g, dtype=torch.float64).log()
            return e / e.sum(-1, keepdim=True)

        self.g_next = zipf_draw(vocab, self.GLOBAL_SUCCESSORS)  # (V, n_g)
        self.g_prob = dirichlet(vocab, self.GLOBAL_SUCCESSORS)
        ranks = zipf_draw(topics, vocab, self.TOPIC_SUCCESSORS)
        self.t_next = torch.gather(self.perms[:, None, :].expand(-1, vocab, -1), 2, ranks)  # (K, V, n_t)
        self.t_prob = dirichlet(topics, vocab, self.TOPIC_SUCCESSORS)

    def describe(self) -> dict:
        return dict(kind=type(self).__name__, vocab=self.vocab, topics=self.topics, seed=self.seed,
                    global_successors=self.GLOBAL_SUCCESSORS, topic_successors=self.TOPIC_SUCCESSORS,
                    topic_weight=self.TOPIC_WEIGHT, zipf=self.ZIPF)

    def sample(self, n: int, length: int, seed: int, chunk: int = 16384) -> torch.Tensor:
        """``n`` documents of ``length`` tokens (int32, CPU), drawn in chunks of documents."""
        g = torch.Generator().manual_seed(seed)
        return torch.cat([self._sample(min(chunk, n - i), length, g) for i in range(0, n, chunk)])

    def _sample(self, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        rand = lambda *shape: torch.rand(shape, generator=g, dtype=torch.float64)
        topic = torch.randint(self.topics, (n,), generator=g)
        g_cdf, t_cdf = self.g_prob.cumsum(-1), self.t_prob.cumsum(-1)
        x = torch.empty(n, length, dtype=torch.long)
        rank = torch.searchsorted(self.zipf_cdf, rand(n)).clamp_max(self.vocab - 1)
        x[:, 0] = self.perms[topic, rank]  # topic k's unigram
        for t in range(1, length):
            a, u = x[:, t - 1], rand(n, 1)  # one uniform picks from either row
            jg = torch.searchsorted(g_cdf[a], u).clamp_max(self.GLOBAL_SUCCESSORS - 1)
            jt = torch.searchsorted(t_cdf[topic, a], u).clamp_max(self.TOPIC_SUCCESSORS - 1)
            from_topic = rand(n, 1) < self.TOPIC_WEIGHT
            x[:, t] = torch.where(from_topic, self.t_next[topic, a].gather(1, jt), self.g_next[a].gather(1, jg))[:, 0]
        return x.to(torch.int32)

    def log_probs(self, x: torch.Tensor) -> torch.Tensor:
        """(n, length - 1): log p(x_t | x_<t) under the source, the topic's posterior
        updated token by token. Its mean negated is the floor no model beats on ``x``."""
        x = x.long()
        n = x.shape[0]
        log_post = self.topic_unigram[:, x[:, 0]].T.log()  # (n, K); the uniform prior cancels
        out = torch.empty(n, x.shape[1] - 1, dtype=torch.float64)
        for t in range(1, x.shape[1]):
            a, b = x[:, t - 1], x[:, t]
            pg = (self.g_prob[a] * (self.g_next[a] == b[:, None])).sum(-1)  # (n,)
            pt = (self.t_prob[:, a] * (self.t_next[:, a] == b[None, :, None])).sum(-1).T  # (n, K)
            pk = (1 - self.TOPIC_WEIGHT) * pg[:, None] + self.TOPIC_WEIGHT * pt
            out[:, t - 1] = torch.logsumexp(log_post.log_softmax(-1) + pk.log(), -1)
            log_post = log_post + pk.log()
        return out


# ----------------------------------------------------------------------------- the model


def build_template(opts, vocab: int):
    """The one initialisation every arm starts from: fp32, on the CPU, from --seed."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=opts.hidden, intermediate_size=opts.intermediate,
        num_hidden_layers=opts.layers, num_attention_heads=opts.heads, num_key_value_heads=opts.heads,
        max_position_embeddings=opts.seq, rms_norm_eps=1e-5, tie_word_embeddings=False,
        attn_implementation="sdpa")
    torch.manual_seed(opts.seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()


def lr_at(step: int, peak: float, steps: int, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then a cosine to 0 (Hugging Face's
    cosine schedule; ``step`` counts from 0, so the first step does not run at 0)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def make_optimizer(arm: Arm, model, lr: float, opts):
    import forge_hf
    from forge_hf.optim.optimizer import default_decay_parameter_names

    hyper = dict(lr=lr, betas=BETAS, eps=EPS, weight_decay=opts.weight_decay)
    if arm.state_precision is None:  # the same decay grouping as ForgeOptimizer's
        decay = set(default_decay_parameter_names(model))
        named = list(model.named_parameters())
        groups = [dict(params=[p for n, p in named if n in decay]),
                  dict(params=[p for n, p in named if n not in decay], weight_decay=0.0)]
        return torch.optim.AdamW(groups, fused=True, **hyper)
    # min_params=0: at the default shapes every linear is above the patch's threshold
    # anyway; at tiny test shapes this still fuses them
    forge_hf.patch_model(model, optimizer="adamw", state_precision=arm.state_precision, rounding=arm.rounding,
                         backend=opts.backend, min_params=0, **hyper)
    return forge_hf.ForgeOptimizer(model, **hyper)


def loss_fn(arm: Arm, device: torch.device):
    import forge_hf

    # without the cast cache, which a CUDA graph cannot hold (torch.cuda.make_graphed_callables)
    autocast = lambda: (torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False) if arm.autocast
                        else nullcontext())

    def loss(model, batch):
        with autocast():
            return forge_hf.causal_lm_loss(model, batch)

    return loss


def make_step(model, optimizer, loss, graphed: bool):
    """``step(batch)``: one training step; ``graphed`` (forge's arms on CUDA): a captured one."""
    if graphed:
        import forge_hf

        return forge_hf.GraphedStep(model, optimizer, loss, warmup_steps=2)

    def step(batch):
        loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


@torch.no_grad()
def held_out_loss(model, loss, batches: list[torch.Tensor]) -> float:
    losses = [loss(model, dict(input_ids=x, labels=x)) * x.shape[0] for x in batches]
    return float(torch.stack(losses).sum()) / sum(x.shape[0] for x in batches)


# ---------------------------------------------------------- --quantization-report's states


def fused_moments(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each fused layer's (exp_avg, exp_avg_sq), copied, as (out, in)."""
    from forge_hf.optim.optimizer import fused_layers

    return {name: tuple(s.clone() for s in layer.forge_state.kernel_slots()[:2])
            for name, layer in fused_layers(model).items()}


def gradient_from_moments(m_before: torch.Tensor, m_after: torch.Tensor, beta1: float = BETAS[0]) -> torch.Tensor:
    """The gradient of the step between two fp32 first moments: m' = m + (1 - b1) (g - m)."""
    return (m_after - beta1 * m_before) / (1 - beta1)


def moment_reports(before: dict, after: dict, lr: float, step: int) -> list[dict]:
    """quantization_report of each layer's states before ``step`` with that step's gradient."""
    import forge_hf

    rows = []
    for name, (m, v) in before.items():
        grad = gradient_from_moments(m, after[name][0])
        for precision in REPORT_PRECISIONS:
            r = forge_hf.quantization_report({"exp_avg": m, "exp_avg_sq": v}, grad, precision=precision,
                                             betas=BETAS, eps=EPS)
            rows.append(dict(lr=lr, step=step, layer=name, precision=precision, e_upd=r.e_upd,
                             **{f"e_upd_{k}_alone": e for k, e in r.e_upd_slot.items()},
                             **{f"rel_l2_{k}": e for k, e in r.relative_l2.items()}))
    return rows


# ------------------------------------------------------------------------------ one arm


def train_arm(name: str, lr: float, template, data: torch.Tensor, held_out: list[torch.Tensor], opts,
              observe=None) -> tuple[dict, list[dict]]:
    """Train ``name`` at peak ``lr`` for --steps from ``template``'s weights on ``data``'s
    batches in order; its curve and summary, and --quantization-report's rows (forge_fp32)."""
    arm, device = ALL_ARMS[name], torch.device(opts.device)
    cuda = device.type == "cuda"
    started = time.perf_counter()
    if cuda:
        gc.collect()  # the previous arm's model, optimizer and captured graph
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else 0  # the data, kept on the device
    model = copy.deepcopy(template).to(device=device, dtype=arm.dtype)
    if observe is not None:
        observe.start(name, lr, model)
    optimizer = make_optimizer(arm, model, lr, opts)
    loss = loss_fn(arm, device)
    graphed = arm.state_precision is not None and cuda and not opts.no_graph
    step_fn = make_step(model, optimizer, loss, graphed)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    captures = set(opts.capture_steps) if name == CAPTURE_ARM else set()
    steps, losses, per_step_ms, reports, before = [], [], [], [], None
    t0 = time.perf_counter()
    for step in range(opts.steps + 1):
        if step % opts.eval_every == 0 or step == opts.steps:
            if step:  # the segment since the last evaluation: its mean step, host and device alike
                sync()
                per_step_ms.append((time.perf_counter() - t0) * 1e3 / (step - steps[-1]))
            steps.append(step)
            losses.append(held_out_loss(model, loss, held_out))
            print(f"{name} lr={lr:g} step {step}: held-out loss {losses[-1]:.4f}", flush=True)
            t0 = time.perf_counter()
        if step == opts.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr, opts.steps, opts.warmup_steps)
        batch = data[step * opts.batch:(step + 1) * opts.batch].to(device, torch.long)
        if observe is not None:
            observe.batch(name, lr, step, batch)
        step_fn(dict(input_ids=batch, labels=batch))
        if captures & {step + 1, step + 2}:  # a captured step's moments: before it and after it
            now = fused_moments(model)
            if step + 1 in captures:
                reports += moment_reports(before, now, lr, step + 1)
            before = now
    run = dict(arm=name, lr=lr, steps=steps, eval_loss=losses, final_eval_loss=losses[-1],
               params=sum(p.numel() for p in model.parameters()), graphed=graphed,
               step_ms=statistics.median(per_step_ms), spread_ms=_iqr(per_step_ms),
               peak_gib=(torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None,
               wall_s=time.perf_counter() - started)
    return run, reports


def _iqr(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    q = statistics.quantiles(values, n=4)
    return q[2] - q[0]


def table_row(run: dict, opts, floor: float) -> dict:
    note = (f"final_eval_loss={run['final_eval_loss']:.4f}, lr={run['lr']:g}, steps={opts.steps}, "
            f"{'GraphedStep' if run['graphed'] else 'eager'}, synthetic data floor {floor:.4f}")
    return dict(model=f"llama-{run['params'] / 1e6:.3g}m-synthetic", batch=f"{opts.batch}x{opts.seq}",
                arm=run["arm"], step_ms=run["step_ms"], spread_ms=run["spread_ms"], peak_gib=run["peak_gib"],
                tool="convergence", note=note)


# --------------------------------------------------------------------- summaries and plot


def loss_table(result: dict) -> str:
    """Markdown: each run's final held-out loss and its distance from the reference's."""
    ref = {r["lr"]: r["final_eval_loss"] for r in result["runs"] if r["arm"] == REFERENCE}
    lines = ["| arm | peak lr | final held-out loss | vs fp32_master |", "| --- | --- | --- | --- |"]
    for r in sorted(result["runs"], key=lambda r: (r["lr"], list(ALL_ARMS).index(r["arm"]))):
        gap = f"{100 * (r['final_eval_loss'] / ref[r['lr']] - 1):+.2f}%" if r["lr"] in ref else ""
        lines.append(f"| {r['arm']} | {r['lr']:g} | {r['final_eval_loss']:.4f} | {gap} |")
    lines.append(f"\nFloor (the source's own loss on the held-out set): {result['floor']:.4f} nats; "
                 f"uniform guess: {math.log(result['language']['vocab']):.4f}.")
    return "\n".join(lines) + "\n"


def quantization_table(rows: list[dict]) -> str:
    """Markdown: per (lr, step, precision), E_upd over the fused layers (median, max) and that
    of the second moment stored alone."""
    keyed: dict[tuple, list[dict]] = {}
    for r in rows:
        keyed.setdefault((r["lr"], r["step"], r["precision"]), []).append(r)
    lines = ["| peak lr | step | state | E_upd median | E_upd max | exp_avg_sq alone median | exp_avg_sq alone max |",
             "| --- " * 7 + "|"]
    for (lr, step, precision), rs in sorted(keyed.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                            REPORT_PRECISIONS.index(kv[0][2]))):
        e, v = [r["e_upd"] for r in rs], [r["e_upd_exp_avg_sq_alone"] for r in rs]
        lines.append(f"| {lr:g} | {step} | {precision} | {statistics.median(e):.3%} | {max(e):.3%} "
                     f"| {statistics.median(v):.3%} | {max(v):.3%} |")
    return "\n".join(lines) + "\n"


COLORS = dict(fp32_master="black", bf16_adamw="tab:gray", forge_bf16_sr="tab:red", forge_bf16_nearest="tab:orange",
              forge_int8="tab:blue", forge_al8="tab:green", forge_fp32="tab:purple",
              forge_log4="tab:olive", forge_log4_factored="tab:cyan")


def plot(result: dict):
    """A matplotlib Figure, one column per peak lr: held-out loss against step (the source's
    floor dashed), and below it each arm's distance from the reference in percent."""
    from matplotlib.figure import Figure

    lrs = sorted({r["lr"] for r in result["runs"]})
    fig = Figure(figsize=(6 * len(lrs), 7))
    axes = fig.subplots(2, len(lrs), squeeze=False, sharex="col", gridspec_kw=dict(height_ratios=[3, 2]))
    for j, lr in enumerate(lrs):
        runs = sorted((r for r in result["runs"] if r["lr"] == lr), key=lambda r: list(ALL_ARMS).index(r["arm"]))
        ref = next((r for r in runs if r["arm"] == REFERENCE), None)
        top, bottom = axes[0][j], axes[1][j]
        late = [-1.0, 1.0]  # the gaps over the second half of training, where the target is judged
        for r in runs:
            top.plot(r["steps"], r["eval_loss"], label=r["arm"], color=COLORS[r["arm"]], lw=1.2)
            if ref is not None and r["steps"] == ref["steps"]:
                gap = [100 * (a / b - 1) for a, b in zip(r["eval_loss"], ref["eval_loss"])]
                bottom.plot(r["steps"][1:], gap[1:], color=COLORS[r["arm"]], lw=1.2)
                late += [g for s, g in zip(r["steps"], gap) if s >= r["steps"][-1] / 2]
        top.axhline(result["floor"], color="black", ls="--", lw=0.8, label="source floor")
        later = [v for r in runs for s, v in zip(r["steps"], r["eval_loss"]) if s > 0]  # step 0 squashes the rest
        top.set_ylim(min(later + [result["floor"]]) - 0.1, max(later, default=result["floor"]) + 0.1)
        top.set_title(f"peak lr {lr:g}, cosine with warm-up", fontsize=10)
        top.set_ylabel("held-out loss (nats/token)")
        if j == 0:
            top.legend(fontsize=7)
        bottom.axhspan(-0.5, 0.5, color="tab:green", alpha=0.12, lw=0)
        bottom.axhline(0, color="black", lw=0.6)
        bottom.set_ylim(1.1 * min(late), 1.1 * max(late))  # earlier, larger gaps may leave the panel
        bottom.set_ylabel("vs fp32_master (%)")
        bottom.set_xlabel("step")
    c = result["config"]
    fig.text(0.01, 0.005, f"Llama {result['params'] / 1e6:.3g}M (hidden {c['hidden']}, {c['layers']} layers), "
             f"batch {c['batch']}x{c['seq']}, synthetic topic-Markov language of {result['language']['vocab']} "
             "tokens\nshaded: within 0.5% of the reference", fontsize=7)
    fig.tight_layout(rect=(0, 0.035, 1, 1))
    return fig


RUN_SELECTION = ("arms", "lr", "quantization_report", "capture_steps")  # options that pick runs, not change them


def merge_curves(paths: list[Path]) -> dict:
    """Several --out files' runs as one result (a later file's (arm, lr) wins); they must
    come from the same data and model."""
    merged = None
    for path in paths:
        result = json.loads(Path(path).read_text())
        if merged is None:
            merged = result
            continue
        for key in ("language", "config"):
            mine = {k: v for k, v in merged[key].items() if k not in RUN_SELECTION}
            theirs = {k: v for k, v in result[key].items() if k not in RUN_SELECTION}
            if mine != theirs:
                raise ValueError(f"{path} has another {key} than {paths[0]} ({theirs} vs {mine}): plot curves of "
                                 "the same data, model and steps together")
        keep = {(r["arm"], r["lr"]) for r in result["runs"]}
        merged["runs"] = [r for r in merged["runs"] if (r["arm"], r["lr"]) not in keep] + result["runs"]
        merged["quantization"] = merged.get("quantization", []) + result.get("quantization", [])
    return merged


def write_outputs(result: dict, opts) -> None:
    if opts.png and result["runs"]:
        plot(result).savefig(opts.png, dpi=110)
    text = loss_table(result) + (("\n" + quantization_table(result["quantization"]))
                                 if result.get("quantization") else "")
    if opts.md:
        Path(opts.md).write_text(text)
    print(text, end="")


# ----------------------------------------------------------------------------- command line


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {list(ARMS)}")
    ap.add_argument("--lr", default="3e-5,1e-3", help="peak learning rates, comma-separated (one panel each)")
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up (default: 5%% of --steps)")
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-sequences", type=int, default=256, help="held-out documents")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256, help="tokens per document")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x --hidden)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default --hidden / 64)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--topics", type=int, default=32)
    ap.add_argument("--data-seed", type=int, default=0, help="the language and its documents")
    ap.add_argument("--seed", type=int, default=0, help="the initial weights")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="forge's: auto, triton or reference (default: auto on "
                                                    "CUDA, reference on CPU)")
    ap.add_argument("--no-graph", action="store_true", help="forge's arms eager on CUDA too")
    ap.add_argument("--quantization-report", action="store_true",
                    help=f"also run {CAPTURE_ARM} and report the update error of {'/'.join(REPORT_PRECISIONS)} "
                         "storage on its moments")
    ap.add_argument("--capture-steps", default=None,
                    help="steps whose update is measured (default: 2%%, 20%%, 50%% and 100%% of --steps)")
    ap.add_argument("--out", type=Path, help="the curves (and reports) as JSON")
    ap.add_argument("--png", type=Path, help="the plot")
    ap.add_argument("--md", type=Path, help="the final losses (and reports) as markdown")
    ap.add_argument("--curves", type=Path, nargs="+", help="draw --png/--md from these --out files; no training")
    ap.add_argument("--jobs", type=int, default=1,
                    help="train this many (arm, lr) pairs at once, each in a process of its own with its share "
                         "of the CPU's threads; their curves merged")
    add_table_option(ap)
    opts = ap.parse_args(argv)
    try:
        check(opts)
    except ValueError as e:
        ap.error(str(e))
    return opts


def check(opts) -> None:
    """Fill the derived defaults; a ValueError names a bad option and its fix."""
    if opts.curves:
        if not (opts.png or opts.md):
            raise ValueError("--curves only draws: give --png and/or --md to write")
        return
    opts.arms = opts.arms.split(",")
    bad = [a for a in opts.arms if a not in ALL_ARMS]
    if bad:
        raise ValueError(f"unknown arm(s) {bad} in --arms: choose from {list(ALL_ARMS)}")
    try:
        opts.lr = [float(v) for v in opts.lr.split(",")]
    except ValueError:
        raise ValueError(f"--lr {opts.lr!r} is not a comma-separated list of numbers: e.g. --lr 3e-5,1e-3") from None
    if not all(v > 0 for v in opts.lr):
        raise ValueError(f"--lr {opts.lr} has a learning rate <= 0: give positive peak rates")
    for name in ("steps", "eval_every", "eval_sequences", "batch", "hidden", "layers", "topics", "jobs"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(opts, name)} must be at least 1")
    if opts.seq < 2 or opts.vocab < 16:
        raise ValueError(f"--seq {opts.seq} / --vocab {opts.vocab}: a document needs 2+ tokens, the language 16+")
    opts.intermediate = opts.intermediate or 3 * opts.hidden
    opts.heads = opts.heads or max(1, opts.hidden // 64)
    if opts.hidden % opts.heads:
        raise ValueError(f"--hidden {opts.hidden} is not divisible by --heads {opts.heads}: pick heads dividing it")
    opts.warmup_steps = max(1, opts.steps // 20) if opts.warmup_steps is None else opts.warmup_steps
    if not 1 <= opts.warmup_steps <= opts.steps:
        raise ValueError(f"--warmup-steps {opts.warmup_steps} must be between 1 and --steps {opts.steps}")
    if opts.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {opts.device} but no CUDA device is visible: use --device cpu (tiny settings)")
    opts.backend = opts.backend or ("reference" if opts.device == "cpu" else "auto")
    if opts.capture_steps is None:
        opts.capture_steps = sorted({min(opts.steps, max(2, round(f * opts.steps))) for f in (0.02, 0.2, 0.5, 1)})
    else:
        opts.capture_steps = [int(v) for v in opts.capture_steps.split(",")]
    bad = [s for s in opts.capture_steps if not 2 <= s <= opts.steps]
    if bad:
        raise ValueError(f"--capture-steps {bad} outside 2..--steps {opts.steps}: a step's gradient comes from the "
                         "moments before and after it, so the first measurable step is 2")
    if opts.quantization_report and CAPTURE_ARM not in opts.arms:
        opts.arms.append(CAPTURE_ARM)


# ------------------------------------------------------------------------------ --jobs

# what a child process needs to train one (arm, lr) of this run as the parent would
CHILD_OPTIONS = ("steps", "warmup_steps", "eval_every", "eval_sequences", "batch", "seq", "hidden", "layers",
                 "intermediate", "heads", "vocab", "topics", "data_seed", "seed", "weight_decay", "device",
                 "backend", "capture_steps")


def child_argv(opts, arm: str, lr: float, out: Path) -> list[str]:
    """The command line that trains (arm, lr) of this run in a process of its own."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--arms", arm, "--lr", repr(lr), "--out", str(out),
            "--table", str(opts.table)]
    for name in CHILD_OPTIONS:
        value = getattr(opts, name)
        argv += [f"--{name.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, list) else str(value)]
    if opts.no_graph:
        argv.append("--no-graph")
    if arm == CAPTURE_ARM and opts.quantization_report:
        argv.append("--quantization-report")
    return argv


def run_in_processes(opts, poll_s: float = 0.5) -> dict:
    """Every (arm, lr) in a process of its own, --jobs at a time, each with its share of the
    CPU's threads: processes drawing their documents side by side at the full thread count
    stall one another. Each appends its own row; the result merges their curves in the
    order one process would have trained them."""
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // opts.jobs)))
    with contextlib.ExitStack() as stack:
        if opts.out:
            parts = opts.out.parent / f"{opts.out.stem}_parts"
            parts.mkdir(parents=True, exist_ok=True)
        else:
            parts = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        runs = [(arm, lr, parts / f"{arm}_{lr:g}.json") for lr in opts.lr for arm in opts.arms]
        pending, running = list(runs), []
        try:
            while pending or running:
                while pending and len(running) < opts.jobs:
                    arm, lr, out = pending.pop(0)
                    running.append((arm, lr, subprocess.Popen(child_argv(opts, arm, lr, out), env=env)))
                time.sleep(poll_s)
                for arm, lr, child in list(running):
                    if child.poll() is None:
                        continue
                    running.remove((arm, lr, child))
                    if child.returncode:
                        raise RuntimeError(f"the process training {arm} at lr {lr:g} exited with {child.returncode} "
                                           "(its output is above)")
        finally:
            for _, _, child in running:
                child.kill()
        return merge_curves([out for _, _, out in runs])


def main(argv=None, observe=None) -> dict:
    """Train every (arm, lr), append its row, write --out/--png/--md; the result dict.
    ``observe`` (tests): ``start(arm, lr, model)`` before each arm's first step and
    ``batch(arm, lr, step, input_ids)`` before each step."""
    opts = parse_args(argv)
    if opts.curves:
        result = merge_curves(opts.curves)
        write_outputs(result, opts)
        return result
    if opts.jobs > 1:
        result = run_in_processes(opts)
        if opts.out:
            opts.out.write_text(json.dumps(result, indent=1))
        write_outputs(result, opts)
        return result
    language = TopicMarkovLanguage(opts.vocab, opts.topics, opts.data_seed)
    # training and held-out documents from two streams of the same source
    data = language.sample(opts.steps * opts.batch, opts.seq, seed=2 * opts.data_seed + 1).to(opts.device)
    held_cpu = language.sample(opts.eval_sequences, opts.seq, seed=2 * opts.data_seed + 2)
    floor = -float(language.log_probs(held_cpu).mean())
    held_out = list(held_cpu.to(opts.device, torch.long).split(opts.batch))
    template = build_template(opts, opts.vocab)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()
              if k not in ("out", "png", "md", "curves", "table")}
    result = dict(config=config, language=language.describe(), floor=floor,
                  params=sum(p.numel() for p in template.parameters()), runs=[], quantization=[])
    print(f"{result['params']:,} parameters; source floor {floor:.4f} nats, uniform {math.log(opts.vocab):.4f}")
    for lr in opts.lr:
        for name in opts.arms:
            run, reports = train_arm(name, lr, template, data, held_out, opts, observe)
            result["runs"].append(run)
            result["quantization"] += reports
            append_rows([table_row(run, opts, floor)], opts.table)  # kept if a later arm dies
            if opts.out:
                opts.out.write_text(json.dumps(result, indent=1))
    write_outputs(result, opts)
    return result


if __name__ == "__main__":
    main()
