"""Model construction, loss and schedule, the recall stages and the task-phase training loop."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from calib.data import TASKS
from calib.data.vocab import seed_from
from recall_stage import RecallTokens, evaluate_stage, train_stage

from .config import TrainConfig
from .data import StepBatches, worker_init


def build_model(cfg: TrainConfig, arch: dict, tokenizer):
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=arch["hidden_size"], intermediate_size=cfg.intermediate_size,
        num_hidden_layers=arch["num_layers"], num_attention_heads=arch["num_heads"],
        num_key_value_heads=arch["num_kv_heads"], head_dim=arch["head_dim"],
        max_position_embeddings=arch["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": float(arch["rope_theta"])},
        rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
        initializer_range=cfg.initializer_range, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    return model


def load_weights(model, model_dir: Path) -> None:
    """Copy a saved model's weights into ``model`` (strict: same architecture, same tokenizer size)."""
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        raise SystemExit(f"error: --init-from {model_dir}: no model.safetensors there")
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise SystemExit(f"error: --init-from {model_dir}: architecture differs ({str(e).splitlines()[-1].strip()})")
    missing = [k for k in missing if not (k == "lm_head.weight" and model.config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"error: --init-from {model_dir}: architecture differs "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")


def loss_terms(model, batch: dict[str, torch.Tensor], device: torch.device, autocast: bool):
    """(answer loss, LM loss, answer-token accuracy, per-row [right, answer tokens]). Targets are the next
    tokens; an answer position is one whose next token is an answer token. Answer loss: mean per
    example, then over examples."""
    ids = batch["input_ids"].to(device, non_blocking=True)
    ans = batch["answer"].to(device, non_blocking=True)[:, 1:]  # [B, T-1]: next token is an answer token
    lm = batch["lm"].to(device, non_blocking=True)[:, 1:]       # next token carries the LM loss
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]  # [B, T-1, H]
        logits = model.lm_head(hidden).float()                           # [B, T-1, V]
    targets = ids[:, 1:]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # [B, T-1]
    ans_f, lm_f = ans.float(), lm.float()
    per_example = (ce * ans_f).sum(1) / ans_f.sum(1).clamp(min=1)
    answer_loss = per_example.mean()
    lm_loss = (ce * lm_f).sum() / lm_f.sum().clamp(min=1)
    right = ((logits.argmax(-1) == targets) & ans).sum(1)
    correct = right.sum() / ans.sum().clamp(min=1)
    return answer_loss, lm_loss, correct, torch.stack([right, ans.sum(1)], 1)


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.total_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_optimizer(cfg: TrainConfig, model, device: torch.device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=device.type == "cuda")


def run_recall(cfg: TrainConfig, model, device: torch.device, log, checkpoint=None) -> dict:
    """Stage 0: each recall stage in turn (its own optimizer and schedule), then held-out recall accuracy
    per format and number of pairs, logged and returned for training_config.json and the card.
    ``checkpoint(record)``, if given, runs after every stage with the record so far."""
    tokens = RecallTokens.tiny()
    out = {"stages": [], "log": [], "eval": {}}
    t0 = time.time()
    for i, stage in enumerate(cfg.recall):
        seed = seed_from("calib-recall", cfg.seed, i) % 2**63
        records = train_stage(model, stage, tokens, device, seed, log, cfg.log_every, name=f"recall{i}")
        checks = [r for r in records if "check_acc" in r]
        out["stages"].append({**asdict(stage), "steps_run": records[-1]["step"] if records else stage.steps,
                              "reached": checks[-1]["reached"] if checks else None})
        out["log"] += records
        if checkpoint is not None:
            checkpoint({**out, "completed_stages": i + 1})
        if out["stages"][-1]["reached"] is False:
            # the later stages build on this one's circuit: a JSON stage after an unbroken k-v stage stays at
            # chance, so training them on a half-formed one wastes the run
            raise SystemExit(f"error: recall stage {i} ({'+'.join(stage.formats)}) did not reach {stage.until} "
                             f"held-out accuracy at {stage.until_pairs or stage.max_pairs} pairs in {stage.steps} "
                             f"steps; the plateau breaks at a seed-dependent step - run again with another "
                             f"--seed (weights so far: {'saved' if checkpoint else 'not saved'})")
    formats = list(dict.fromkeys(f for st in cfg.recall for f in st.formats))
    out["eval"] = evaluate_stage(model, formats, cfg.recall_eval_pairs, tokens, device, seed=cfg.seed,
                                 batch=cfg.recall_eval_batch)
    out["seconds"] = round(time.time() - t0, 1)
    log(f"recall accuracy (held out, teacher forced) by format and pairs: {json.dumps(out['eval'])}")
    return out


def train(cfg: TrainConfig, model, tokenizer, device: torch.device, log) -> dict:
    data = StepBatches(cfg, tokenizer)
    loader = torch.utils.data.DataLoader(
        data, batch_size=None, shuffle=False, num_workers=cfg.workers, pin_memory=device.type == "cuda",
        prefetch_factor=8 if cfg.workers else None, persistent_workers=False, worker_init_fn=worker_init)
    opt = make_optimizer(cfg, model, device)
    model.train()
    autocast = device.type == "cuda"
    stats = {"answer_loss": 0.0, "lm_loss": 0.0, "answer_acc": 0.0, "tokens": 0, "wait": 0.0, "n": 0}
    history, t_start, t_mark = [], time.time(), time.time()
    t_data = time.time()
    for step, batch in enumerate(loader):
        stats["wait"] += time.time() - t_data
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        answer_loss, lm_loss, acc, rows = loss_terms(model, batch, device, autocast)
        loss = answer_loss + cfg.lm_loss_weight * lm_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        stats["n"] += 1
        stats["tokens"] += int((batch["input_ids"] != data.pad).sum())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.total_steps:
            for k, v in (("answer_loss", answer_loss), ("lm_loss", lm_loss), ("answer_acc", acc)):
                stats[k] = float(v.detach())  # last step's values (one sync per log line)
            now = time.time()
            by_task = torch.zeros(len(TASKS), 2, dtype=torch.long).index_add_(0, batch["task"], rows.cpu())
            rec = {"step": step + 1, "phase": data.phase(step).name, "len": int(batch["target_len"]),
                   "batch": int(batch["input_ids"].shape[0]), "lr": lr_at(cfg, step),
                   "answer_loss": round(stats["answer_loss"], 4), "lm_loss": round(stats["lm_loss"], 4),
                   "answer_acc": round(stats["answer_acc"], 4),
                   "acc_by_task": {t: round(int(r) / int(n), 3) for t, (r, n) in zip(TASKS, by_task.tolist()) if n},
                   "grad_norm": round(float(gnorm), 3),
                   "ms_per_step": round(1000 * (now - t_mark) / stats["n"], 1),
                   "data_wait_ms": round(1000 * stats["wait"] / stats["n"], 1),
                   "tokens_per_s": int(stats["tokens"] / (now - t_mark)),
                   "elapsed_s": round(now - t_start, 1)}
            rec["eta_s"] = round(rec["elapsed_s"] / (step + 1) * (cfg.total_steps - step - 1), 0)
            history.append(rec)
            log(json.dumps(rec))
            stats.update(tokens=0, wait=0.0, n=0)
            t_mark = now
        t_data = time.time()
    return {"train_seconds": round(time.time() - t_start, 1), "log": history}
