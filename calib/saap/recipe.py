"""``python -m calib run +method=saap``: k-means buckets + query classifiers, evaluated (docs/methods.md, SAAP).

Stages, timed as ``time_<stage>_s`` (per-layer ones also ``compute_<stage>_s`` over resumed runs):

1. ``load`` — the model, the calibration prompts and the held-out ``method.eval`` prompts.
2. ``collect`` — keys per (prompt, non-dense layer, KV head) among the bucket candidates ``[sink, T - recent)``.
3. ``kmeans`` — per (non-dense layer, KV head) L2 k-means on the de-RoPE'd keys (seed ``cfg.seed + h``)
   and, with ``method.report=full``, on the RoPE'd keys (the ``kmeans_rope`` baseline).
4. ``targets`` — long-range queries per head and their rows of ``A·H_k``; with
   ``classifier.teacher_forced_answer`` also the gold answer's decode positions (:data:`ANSWER_ROOM`).
5. ``classifier`` — per layer all query heads train at once (batched weights, Adam); loss curves to MLflow.
   ``layers`` (``method.layer_profile.enabled``): per-layer ℓ by greedy answers (:mod:`.layer_profile`).
6. ``eval`` — held-out decode-like queries: selectivity, recall and output error of SAAP and the window
   alone, plus the k-means baselines and oracles with ``method.report=full`` (:mod:`calib.saap.report`).

Artifact (read by :meth:`runtime_kernels.saap.SaapDecode.from_artifact`): hyperparameters ``sink``,
``window``, ``top_l``, ``dense_layers``, ``bn_eps`` (plus every calibration setting); per non-dense layer
``l`` the tensors ``layers.<l>.<field>`` of :attr:`SaapLayerParams.TENSOR_FIELDS` in ``layer_<l>``.
Design notes (each stage in detail, answer-aware calibration): docs/notes/saap-recipe.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from tqdm.auto import tqdm

from calib.collect import CollectConfig, collect, run_layer_callbacks
from calib.collect.sampling import sample_generator
from calib.config import layer_map, require
from calib.data import build_prompts, take_in_turn
from calib.data.books import ANSWERED_TASKS, BOOK_TASKS
from calib.data.prompt import answer_token_ids  # noqa: F401 (public here too: the targets' answers)
from calib.data.synthetic import TASKS
from calib.errors import UserError
from calib.models import load_model
from calib.recipe_settings import Section, layer_scales, report_mode
from calib.rope import derope, rotary_cos_sin
from calib.run import MethodOutput
from calib.saap import layer_profile, resume
from calib.saap.artifact import hyperparameters, method_output  # noqa: F401 (hyperparameters: public here too)
from calib.saap.classifier import BatchedQueryClassifier, fit_query_classifiers
from calib.saap.kmeans import assign
from calib.saap.kmeans_stage import kmeans_layer
from calib.saap.metrics import LayerEvaluation, eval_query_positions, evaluate_layer
from calib.saap.targets import prompt_training_rows, top1_key_distance
from runtime_kernels.saap.reference import SaapLayerParams

# calib.saap.report (matplotlib, mlflow) is imported where used: the CLI imports this recipe for its checks
# of a run's settings and data, which must fail fast.

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class Settings:
    """``cfg.method`` read and range-checked once (conf/method/saap/default.yaml documents every key)."""

    clusters: int
    iterations: int
    window: int
    sink: int
    long_range: int
    top_l: int
    top_l_layers: dict[int, int]
    top_ls: list[int]
    dense_layers: list[int]
    causal_targets: bool
    prompts: int
    calib_lengths: list[int] | None
    kmeans_backend: str
    kmeans_use_gpu: bool | str
    max_points_per_centroid: int
    hidden: int
    lr: float
    steps: int
    batch: int
    queries_per_prompt: int
    query_candidates: int | None
    teacher_forced_answer: bool
    classifier_seed: int
    classifier_heads: str  # "query": one classifier per query head; "kv": one per KV head (paper §5)
    eval_prompts: int
    eval_queries: int
    eval_length: int | None
    baseline_probe: str
    oracle: bool
    recall_targets: list[float]
    report: str
    profile: layer_profile.ProfileSettings

    @property
    def full_report(self) -> bool:
        """``method.report=full``: also the k-means baselines (RoPE'd k-means, IVF probes) and the oracles."""
        return self.report == "full"

    @property
    def recent(self) -> int:
        return self.window - self.sink

    @property
    def evaluated_ls(self) -> list[int]:
        """``top_ls`` plus the default ℓ of every layer (``top_l`` and the ``top_l_layers`` values), sorted."""
        return sorted(set(self.top_ls) | {self.top_l} | set(self.top_l_layers.values()))

    def layer_top_l(self, layer: int) -> int:
        """The default ℓ the artifact gives ``layer``: its ``top_l_layers`` entry, else ``top_l``."""
        return self.top_l_layers.get(layer, self.top_l)

    @classmethod
    def from_cfg(cls, cfg: Any) -> "Settings":
        """Every ``method.*`` key of ``cfg`` (one-line :class:`UserError` for a bad one); dense layers and
        per-layer ℓ are checked against ``model.arch.num_layers``."""
        m = Section(cfg.method, "method")
        km, cl, ev = m.section("kmeans"), m.section("classifier"), m.section("eval")
        sink, window = m.integer("sink", at_least=0), m.integer("window")
        require(window > sink, f"method.window must be > method.sink={sink} (got {window}): the dense region is the "
                               f"sink plus window - sink recent keys")
        s = cls(
            clusters=m.integer("clusters", at_least=2), iterations=m.integer("iterations", at_least=1),
            window=window, sink=sink, long_range=m.integer("long_range", at_least=0),
            top_l=m.integer("top_l", at_least=1),
            top_l_layers=layer_map(m.value("top_l_layers"), m.key("top_l_layers")),
            top_ls=m.integers("top_ls", at_least=1), dense_layers=m.integers("dense_layers", at_least=0),
            causal_targets=m.flag("causal_targets"), prompts=m.integer("prompts", at_least=1),
            calib_lengths=m.integers("calib_lengths", optional=True, at_least=1),
            kmeans_backend=km.choice("backend", ("auto", "faiss", "torch")),
            kmeans_use_gpu=km.choice("use_gpu", ("auto", True, False)),
            max_points_per_centroid=km.integer("max_points_per_centroid", at_least=1),
            hidden=cl.integer("hidden", at_least=1), lr=cl.number("lr", above=0), steps=cl.integer("steps", at_least=1),
            batch=cl.integer("batch", at_least=1), queries_per_prompt=cl.integer("queries_per_prompt", at_least=1),
            query_candidates=cl.integer("query_candidates", optional=True, at_least=1),
            teacher_forced_answer=cl.flag("teacher_forced_answer"), classifier_seed=cl.integer("seed"),
            classifier_heads=cl.choice("heads", ("query", "kv")),
            eval_prompts=ev.integer("prompts", at_least=1), eval_queries=ev.integer("queries_per_prompt", at_least=1),
            eval_length=ev.integer("length", optional=True, at_least=1),
            baseline_probe=ev.choice("baseline_probe", ("head", "group", "both")), oracle=ev.flag("oracle"),
            recall_targets=ev.numbers("recall_at_selectivity", above=0, below=1), report=report_mode(m),
            profile=layer_profile.ProfileSettings.read(m.section("layer_profile")),
        )
        s.check_layers(Section(cfg.model, "model").section("arch").integer("num_layers", at_least=1))
        return s

    def check_layers(self, n_layers: int) -> None:
        """``dense_layers`` and ``top_l_layers`` name layers of a model of ``n_layers`` and leave one sparse."""
        bad = [x for x in self.dense_layers if x >= n_layers]
        require(not bad, f"method.dense_layers={self.dense_layers} out of range: the model has layers "
                         f"0..{n_layers - 1}")
        require(len(set(self.dense_layers)) < n_layers, "method.dense_layers covers every layer: nothing to calibrate")
        bad = sorted(x for x in self.top_l_layers if x >= n_layers)
        require(not bad, f"method.top_l_layers names layers {bad} out of range: the model has layers 0..{n_layers - 1}")
        dense = sorted(set(self.top_l_layers) & set(self.dense_layers))
        require(not dense, f"method.top_l_layers names dense layers {dense}: they attend to every key and have no ℓ")


def validate(cfg: DictConfig) -> None:
    """Range checks of ``cfg.method`` (one-line :class:`UserError`); a layer profile on generated data must
    name tasks that data generates (``data=synthetic`` on the command line with a model whose profile
    answers book needles fails here, not after the calibration)."""
    profile = Settings.from_cfg(cfg).profile
    source = str(cfg.data.get("source", "synthetic"))
    generated = {"synthetic": TASKS, "books": BOOK_TASKS}.get(source)
    if profile.enabled and profile.tasks and generated is not None:
        unknown = sorted(set(profile.tasks) - set(generated))
        require(not unknown, f"method.layer_profile.tasks names {unknown}, which data={source} does not generate "
                             f"(its tasks: {', '.join(generated)}): set method.layer_profile.tasks")


# ------------------------------------------------------------------------------------------ prompts
def data_needs(cfg: DictConfig) -> dict[str, str | None]:
    """Calibration and held-out rows, no answers needed (a gold answer, when given, is teacher-forced),
    unless ``method.layer_profile`` scores greedy answers on rows of the data. A profile on named tasks of
    generated data (synthetic tasks, book needles) needs no check: those prompts always carry answers."""
    profile = Settings.from_cfg(cfg).profile
    generated = str(cfg.data.get("source", "synthetic")) in ("synthetic", "books")
    answered = profile.tasks is not None and set(profile.tasks) <= {*TASKS, *ANSWERED_TASKS}
    needs = profile.enabled and not (generated and answered)
    return {"calibration": "SAAP's layer profile scores greedy answers" if needs else None, "evaluation": None}


ANSWER_ROOM = 64  # positions a teacher-forced calibration prompt leaves free for its gold answer


def longest_calibration_prompt(cfg: DictConfig, s: Settings) -> int | None:
    """The model's context (``model.arch.max_position_embeddings``) less :data:`ANSWER_ROOM` when the
    gold answer is teacher-forced after each prompt; None when the model states no context."""
    limit = OmegaConf.select(cfg, "model.arch.max_position_embeddings")
    if limit is None:
        return None
    return int(limit) - (ANSWER_ROOM if s.teacher_forced_answer else 0)


def prompt_lengths(cfg: DictConfig, s: Settings) -> tuple[list[int], int]:
    """``(calibration lengths, evaluation length)``: ``method.calib_lengths``, default the data lengths
    but the evaluation length, and ``method.eval.length``, default the second longest data length (a
    length never calibrated on when the data has several). Default calibration lengths longer than
    :func:`longest_calibration_prompt` are cut to it: SmolLM2's data lengths end at its 8192-token
    context, and ``prompt + answer`` must fit (8128 there)."""
    lengths = sorted({int(x) for x in cfg.data.lengths})
    eval_length = s.eval_length if s.eval_length is not None else (lengths[-2] if len(lengths) > 1 else lengths[-1])
    calib = s.calib_lengths
    if not calib:
        limit = longest_calibration_prompt(cfg, s)
        calib = [n if limit is None else min(n, limit) for n in ([n for n in lengths if n != eval_length] or lengths)]
    return sorted(set(calib)), int(eval_length)


def check_answer_room(cfg: DictConfig, s: Settings, prompts: Sequence[Any], tokenizer: Any) -> None:
    """One-line UserError, before any collection, when a calibration prompt plus its teacher-forced
    answer passes the model's context (the targets pass would fail after collection and k-means)."""
    limit = OmegaConf.select(cfg, "model.arch.max_position_embeddings")
    if limit is None or not s.teacher_forced_answer:
        return
    for p in prompts:
        n = len(p.input_ids) + len(answer_token_ids(tokenizer, p))
        if n > int(limit):
            raise UserError(f"calibration prompt {p.prompt_id} has {len(p.input_ids)} tokens and its answer "
                            f"{n - len(p.input_ids)} more, past model {cfg.model.name!r}'s {int(limit)} positions: "
                            f"use method.calib_lengths <= {int(limit) - ANSWER_ROOM} or "
                            f"method.classifier.teacher_forced_answer=false")


def _in_turn(prompts: Sequence[Any], n: int, what: str) -> list[Any]:
    """``n`` prompts taking the (length, task) groups in turn."""
    chosen = take_in_turn(prompts, n)
    if len(chosen) < n:
        raise UserError(f"only {len(chosen)} {what} prompts available but {n} requested; lower the count or "
                        f"provide more data")
    return chosen


def build_prompt_sets(cfg: DictConfig, s: Settings, tokenizer: Any) -> tuple[list[Any], list[Any], list[int], int]:
    """``(calibration prompts, held-out prompts, calibration lengths, evaluation length)``."""
    calib_lengths, eval_length = prompt_lengths(cfg, s)
    tasks = [str(t) for t in cfg.data.tasks or []]  # file/hub data: rows of any task, of any length
    synthetic = str(cfg.data.get("source", "synthetic")) in ("synthetic", "books")  # generated per task and length
    per = math.ceil(s.prompts / (max(1, len(tasks)) * len(calib_lengths))) if synthetic else s.prompts
    held_per = math.ceil(s.eval_prompts / max(1, len(tasks))) if synthetic else s.eval_prompts
    calib = build_prompts(cfg.data, tokenizer, seed=int(cfg.data.seed), lengths=calib_lengths, tasks=tasks,
                          num_prompts=per, purpose="calibration")
    held = build_prompts(cfg.data, tokenizer, seed=int(cfg.eval.seed), lengths=[eval_length], tasks=tasks,
                         num_prompts=held_per, purpose="evaluation")
    chosen = _in_turn(calib, s.prompts, "calibration")
    check_answer_room(cfg, s, chosen, tokenizer)
    return chosen, _in_turn(held, s.eval_prompts, "evaluation"), calib_lengths, eval_length


# ---------------------------------------------------------------------------------- collect + kmeans
def keys_per_prompt(s: Settings, num_prompts: int) -> int:
    """Key positions sampled per (prompt, layer, KV head) for k-means: together the ``clusters x
    max_points_per_centroid`` keys per KV head that k-means subsamples to at most."""
    return math.ceil(s.clusters * s.max_points_per_centroid / num_prompts)


def collect_keys(cfg: DictConfig, loaded: Any, prompts: Sequence[Any], s: Settings, layers: list[int]) -> Any:
    """The collected set (RoPE'd keys of ``layers``) of the calibration prompts (cached, resumable)."""
    base = CollectConfig.from_any(cfg.get("collect"))
    ccfg = dataclasses.replace(base, keys_per_head=keys_per_prompt(s, len(prompts)), queries_per_head=1,
                               store=["k_post"], layers=layers)
    return collect(loaded, [p.input_ids for p in prompts], ccfg)


# ---------------------------------------------------------------------------------- second pass
def derope_capture(model: Any, cap: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """De-RoPE'd ``(q [Hq, T, D], k [Hkv, T, D])`` float32 of a capture, with the model's rotary module."""
    cos, sin = rotary_cos_sin(model, cap.positions)
    cos, sin = cos.to(cap.q_post.device), sin.to(cap.q_post.device)
    return derope(cap.q_post, cos, sin, torch.float32), derope(cap.k_post, cos, sin, torch.float32)


def calibration_sequences(tokenizer: Any, prompts: Sequence[Any], teacher_forced_answer: bool
                          ) -> tuple[list[list[int]], list[int]]:
    """Token ids of the targets/classifier pass and each prompt's length (where the answer starts)."""
    lengths = [len(p.input_ids) for p in prompts]
    if not teacher_forced_answer:
        return [list(p.input_ids) for p in prompts], lengths
    return [list(p.input_ids) + answer_token_ids(tokenizer, p) for p in prompts], lengths


@dataclass
class TrainingRows:
    """One layer's classifier data: rows of all prompts (CPU)."""

    x: list[torch.Tensor]  # [Hq, n_p, D] de-RoPE'd queries per prompt
    targets: list[torch.Tensor]  # [Hq, n_p, C] rows of A·H_k
    long_range: list[torch.Tensor]  # [Hq, n_p] bool
    prompt: list[int]
    answer: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [Hq, n_p] bool: answer rows
    positions: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [Hq, n_p] query positions

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x [Hq, N, D], targets [Hq, N, C], prompt_index [N])``."""
        index = torch.cat([torch.full((x.shape[1],), p) for x, p in zip(self.x, self.prompt)])
        return torch.cat(self.x, 1), torch.cat(self.targets, 1), index


def training_rows(loaded: Any, prompts: Sequence[Any], centroids: dict[int, torch.Tensor], s: Settings,
                  seed: int) -> dict[int, TrainingRows]:
    """The second pass: per non-dense layer the sampled queries (plus, with ``teacher_forced_answer``,
    the answer positions) and their ``A·H_k`` rows."""
    sequences, prompt_lens = calibration_sequences(loaded.tokenizer, prompts, s.teacher_forced_answer)
    rows = {l: TrainingRows([], [], [], []) for l in centroids}
    scales = layer_scales(loaded.model)
    on_device = {l: c.to(loaded.device) for l, c in centroids.items()}

    def on_layer(cap: Any) -> None:
        if cap.layer not in rows:
            return
        qr, kr = cap.q_post.float(), cap.k_post.float()
        cos, sin = rotary_cos_sin(loaded.model, cap.positions)
        cos, sin = cos.to(qr.device), sin.to(qr.device)
        kd = derope(kr, cos, sin, torch.float32)  # [Hkv, T, D]; queries are de-RoPE'd at the chosen rows only
        prompt_len = prompt_lens[cap.prompt_index]
        pool = prompt_len - max(s.sink, 1)
        n = min(s.queries_per_prompt, pool if s.query_candidates is None else min(pool, s.query_candidates))
        gen = sample_generator(seed, cap.prompt_index, cap.layer, "saap-queries")
        kb = assign(kd, on_device[cap.layer])  # [Hkv, T]
        pr = prompt_training_rows(qr, kr, kb, n, s.long_range, s.clusters, prompt_len=prompt_len, sink=s.sink,
                                  causal_targets=s.causal_targets,
                                  candidates=s.query_candidates, scale=scales[cap.layer], generator=gen)
        r = rows[cap.layer]
        rows_q = qr.gather(1, pr.positions.unsqueeze(-1).expand(-1, -1, qr.shape[-1]))  # [Hq, n, D] RoPE'd
        r.x.append(derope(rows_q, cos[pr.positions], sin[pr.positions], torch.float32).cpu())
        r.targets.append(pr.targets.cpu())
        r.long_range.append(pr.long_range.cpu())
        r.answer.append(pr.answer.cpu())
        r.positions.append(pr.positions.cpu())
        r.prompt.append(cap.prompt_index)

    run_layer_callbacks(loaded, sequences, on_layer, layers=sorted(rows), desc="saap targets")
    return rows


def train_layer(rows: TrainingRows, s: Settings, layer: int, device: torch.device, num_kv_heads: int,
                bar: Any = None) -> tuple[BatchedQueryClassifier, torch.Tensor]:
    """All classifiers of one layer at once -> ``(BatchedQueryClassifier, loss curve [steps, Hc])``; each
    step's batch comes from one prompt (the paper, App. A). ``method.classifier.heads=kv``: one classifier
    per KV head, trained on the queries of its query heads.

    ``bar``: the stage's progress bar (one step per optimizer step); None opens one for this layer."""
    x, t, index = rows.tensors()
    group = x.shape[0] // num_kv_heads if s.classifier_heads == "kv" else 1
    return fit_query_classifiers(x, t, hidden=s.hidden, lr=s.lr, steps=s.steps, batch=s.batch,
                                 seed=s.classifier_seed, group=group, prompt_index=index,
                                 device=device, desc=f"saap classifiers, layer {layer}", bar=bar)


def classifier_layer(rows: TrainingRows, centroids: torch.Tensor, s: Settings, layer: int,
                     device: torch.device, bar: Any = None) -> dict[str, torch.Tensor]:
    """One layer's classifiers as :func:`calib.saap.resume.classifier_to_tensors` (params + loss curve)."""
    if bar is not None:
        bar.set_description(f"saap classifiers, layer {layer}")
    model, curve = train_layer(rows, s, layer, device, centroids.shape[0], bar)  # centroids [Hkv, C, D]
    log.info("saap: layer %d classifiers, KL %.4f -> %.4f (mean over classifiers)", layer,
             float(curve[0].mean()), float(curve[-1].mean()))
    return resume.classifier_to_tensors(model.layer_params(centroids, sink=s.sink, recent=s.recent), curve)


def evaluate(loaded: Any, prompts: Sequence[Any], params: dict[int, SaapLayerParams],
             rope_centroids: dict[int, torch.Tensor], s: Settings, seed: int) -> dict[int, LayerEvaluation]:
    """Per non-dense layer the evaluation of all held-out prompts (queries joined)."""
    scales = layer_scales(loaded.model)
    dev_params = {l: p.to(loaded.device) for l, p in params.items()}
    dev_rope = {l: c.to(loaded.device) for l, c in rope_centroids.items()}
    probe, oracle = (s.baseline_probe, s.oracle) if s.full_report else ("none", False)
    found: dict[int, list[LayerEvaluation]] = defaultdict(list)

    def on_layer(cap: Any) -> None:
        if cap.layer not in dev_params:
            return
        qd, kd = derope_capture(loaded.model, cap)
        n = min(s.eval_queries, cap.num_tokens - s.window)
        qidx = eval_query_positions(cap.num_tokens, s.sink, s.recent, n,
                                    sample_generator(seed, cap.prompt_index, cap.layer, "saap-eval"))
        ev = evaluate_layer(cap.q_post.float(), qd, cap.k_post.float(), kd, cap.v.float(), qidx,
                            params=dev_params[cap.layer], top_ls=s.evaluated_ls,
                            rope_centroids=dev_rope.get(cap.layer), baseline_probe=probe,
                            scale=scales[cap.layer], oracle=oracle)
        dist = top1_key_distance(cap.q_post.float(), cap.k_post.float(), positions=qidx, sink=s.sink,
                                 causal=True, scale=scales[cap.layer])
        found[cap.layer].append(LayerEvaluation(ev.top_ls, {m: {k: v.cpu() for k, v in d.items()}
                                                            for m, d in ev.metrics.items()}, dist.cpu()))

    short = [p for p in prompts if len(p.input_ids) <= s.window]
    if short:
        raise UserError(f"evaluation prompts of {len(short[0].input_ids)} tokens have no key outside the dense window "
                        f"(method.window={s.window}): set method.eval.length longer")
    run_layer_callbacks(loaded, [p.input_ids for p in prompts], on_layer, layers=sorted(params), desc="saap eval")
    return {l: LayerEvaluation.concat(v) for l, v in sorted(found.items())}


# ------------------------------------------------------------------------------------------- recipe
def stage_bar(total: int, desc: str, unit: str) -> Any:
    """A tqdm bar over a stage's known amount of work (so it shows an ETA); closes as a context manager."""
    return tqdm(total=total, desc=desc, unit=unit, leave=False)


def calibrate(cfg: DictConfig, ctx: Any) -> MethodOutput:
    """The SAAP pipeline (see the module docstring); returns the :class:`calib.run.MethodOutput`."""
    from calib.saap import report

    s = Settings.from_cfg(cfg)
    seed = int(cfg.get("seed", 0))
    with ctx.timer.stage("load"):
        loaded = load_model(cfg.model, device=str(ctx.device))
        calib_prompts, held_out, calib_lengths, eval_length = build_prompt_sets(cfg, s, loaded.tokenizer)
    n_layers = loaded.facts.num_layers
    layers = [l for l in range(n_layers) if l not in set(s.dense_layers)]
    if not layers or any(not 0 <= x < n_layers for x in s.dense_layers):
        raise UserError(f"method.dense_layers={s.dense_layers} must be layers of 0..{n_layers - 1} and leave one out")
    with ctx.timer.stage("collect"):
        collected = collect_keys(cfg, loaded, calib_prompts, s, layers)
    centroids, rope_centroids, balance = {}, {}, {}
    ckpt = resume.saap_checkpoints(cfg, loaded.facts.model_hash, calib_prompts)  # finished layers of a killed run
    with ctx.timer.stage("kmeans"), stage_bar(len(layers), "saap k-means", "layer") as bar:
        for layer in layers:
            done = ckpt.layer("kmeans", layer, lambda: kmeans_layer(collected, layer, s, seed, ctx.device))
            centroids[layer], balance[layer] = done["centroids"], float(done["imbalance"])
            if "rope_centroids" in done:  # the kmeans_rope baseline: a report extra (method.report=full)
                rope_centroids[layer] = done["rope_centroids"]
            bar.update(1)
    with ctx.timer.stage("targets"):
        rows = resume.checkpointed_rows(ckpt, layers, lambda todo: training_rows(
            loaded, calib_prompts, {l: centroids[l] for l in todo}, s, seed), TrainingRows)
    params, curves = {}, {}
    with ctx.timer.stage("classifier"), stage_bar(len(layers) * s.steps, "saap classifiers", "step") as bar:
        for layer in layers:  # one bar over every layer's steps, so its ETA is the stage's
            done = ckpt.layer("classifier", layer, lambda: classifier_layer(rows[layer], centroids[layer], s, layer,
                                                                             ctx.device, bar))
            params[layer], curves[layer] = resume.classifier_from_tensors(done, sink=s.sink, recent=s.recent)
            bar.update(s.steps * (layers.index(layer) + 1) - bar.n)  # a layer loaded from its checkpoint
    profile = None
    if s.profile.enabled:
        with ctx.timer.stage("layers"):  # per-layer ℓ by greedy answers, before the report evaluates it
            profile = layer_profile.profile(cfg, s.profile, loaded, params, s, ctx.device,
                                            {p.prompt_id for p in calib_prompts})
        s = dataclasses.replace(s, top_l_layers={**s.top_l_layers, **profile.top_l_layers})
    with ctx.timer.stage("eval"):
        evals = evaluate(loaded, held_out, params, rope_centroids, s, seed)
        head = report.head_curves(evals)
        table = report.summary_table(head, s.evaluated_ls)
        per_layer = report.interpolated_recall(head, s.recall_targets, per_layer=True)
        metrics = report.headline_metrics(head, s.evaluated_ls, [s.layer_top_l(l) for l in layers],
                                          s.recall_targets)
        by_range = report.recall_by_query_range(evals, s.long_range, s.recall_targets)
        metrics["by_query_range"] = by_range
        report.log_report(table, curves, str(cfg.model.name),
                          {"layers": layers, "recall_targets": s.recall_targets, "recall_per_layer": per_layer,
                           "recall_by_query_range": by_range})
    lr_by_layer = {l: float(torch.cat(r.long_range, 1).float().mean()) for l, r in rows.items()}
    answer_rows = {l: int(sum(int(a[0].sum()) for a in r.answer)) for l, r in rows.items()}
    metrics.update({
        "kmeans_imbalance": sum(balance.values()) / len(balance),
        "train_long_range_fraction": sum(lr_by_layer.values()) / len(lr_by_layer),
        "train_answer_rows": sum(answer_rows.values()) / len(answer_rows),
        "classifier_loss_first": float(torch.stack([c[: max(1, len(c) // 20)].mean() for c in curves.values()]).mean()),
        "classifier_loss_last": float(torch.stack([c[-max(1, len(c) // 20):].mean() for c in curves.values()]).mean()),
        **{f"time_{k}_s": v for k, v in ctx.timer.seconds.items()},
        # what each checkpointed stage cost, its layers computed by this run or a killed one it resumed
        **{f"compute_{k}_s": v for k, v in ckpt.seconds.items()},
    })
    payload = {"eval_table": report.json_safe(table), "recall_per_layer": report.json_safe(per_layer),
               "recall_by_query_range": report.json_safe(by_range),
               "layers": layers,
               "kmeans_imbalance": {str(l): v for l, v in balance.items()},
               "training_rows": {str(l): int(sum(x.shape[1] for x in r.x)) for l, r in rows.items()},
               "train_long_range_fraction": {str(l): v for l, v in lr_by_layer.items()},
               "train_answer_rows": {str(l): v for l, v in answer_rows.items()},
               "collected_set": collected.content_hash, "eval_length": eval_length, "eval_prompts": len(held_out)}
    if profile is not None:
        metrics.update(profile.metrics())
        payload["layer_profile"] = profile.table()
        report.log_layer_profile(profile.table(), metrics["layer_profile.dense_acc"], str(cfg.model.name))
    metrics["checkpoint_layers_loaded"] = ckpt.loaded
    ckpt.clear()  # every stage finished: the artifact holds the results
    return method_output(cfg, s, loaded, params, calib_prompts, held_out, calib_lengths, metrics, payload,
                         keys_per_prompt(s, len(calib_prompts)))
