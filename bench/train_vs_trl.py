"""Seconds per step and peak memory: Collage vs TRL's GRPOTrainer / RLOOTrainer, same model, data and settings.

Each (framework, algorithm) runs in its own process so peak RSS (CPU) or peak CUDA memory is its own.
The dataset is multi-image only (1..3 images per prompt): TRL's GRPO fails on text-only rows.
Both sides train the same parameters: the vision tower and the projector (LLaVA's ``multi_modal_projector``,
Idefics3's ``connector``, Qwen2-VL's ``visual.merger``) are frozen in TRL's model by the very function Collage
uses (``prepare_policy`` with ``freeze_vision``), and the run stops unless both report the same trainable names.
Both use ``beta: 0`` (TRL's RLOO default is 0.05, so it is set explicitly on both sides).

    .venv/bin/python bench/train_vs_trl.py [--steps 12] [--family qwen2-vl] [--device cpu|cuda]

Prints a Markdown table; docs/benchmarks.md records the results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = dict(
    per_device_train_batch_size=8,
    num_generations=4,
    max_completion_length=24,
    learning_rate=1e-4,
    temperature=1.0,
    seed=0,
)


def numeric_reward(completions, **kwargs):
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        chars = [ch for ch in text if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


def _peak_memory_mb(device: str) -> float:
    if device == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_collage(algorithm: str, family: str, steps: int, device: str, data: str) -> dict:
    from collage.training.callbacks import Callback
    from collage.training.config import parse_config
    from collage.training.trainer import Trainer

    times: list[float] = []
    timings: list[dict] = []

    class Clock(Callback):
        def on_metrics(self, step, metrics):
            times.append(metrics["step_time"])
            timings.append({k: v for k, v in metrics.items() if k.startswith("timing/")})

    train = {**SETTINGS, "max_steps": steps, "max_prompt_length": 512, "beta": 0.0}
    if algorithm == "grpo":
        train["loss_type"] = "dapo"
    config = parse_config(
        {
            "algorithm": algorithm,
            "model": {"path": f"tiny:{family}", "dtype": "float32", "freeze_vision": True},
            "dataset": {"source": data},
            "rewards": [{"name": "bench.train_vs_trl:numeric_reward"}],
            "train": train,
            "logging": {"samples_every": 0},
            "resources": {"gpus": 1 if device == "cuda" else 0},
        }
    )
    trainer = Trainer(config, None, [Clock()])
    trainer.setup()
    trainable = trainable_names(trainer.accelerator.unwrap_model(trainer.model))
    trainer.train()
    steady = times[2:] or times
    split = {k: sum(t[k] for t in timings[2:] or timings) / len(steady) for k in timings[0]}
    return {
        "seconds_per_step": sum(steady) / len(steady),
        "peak_mb": _peak_memory_mb(device),
        "trainable": trainable,
        **split,
    }


def trainable_names(model) -> list[str]:
    return sorted(name for name, p in model.named_parameters() if p.requires_grad)


def run_trl(algorithm: str, family: str, steps: int, device: str, data: str) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback

    from collage.training.config import ModelSettings
    from collage.training.data.loader import load_dataset
    from collage.training.modeling import prepare_policy
    from collage.training.models.loading import resolve_model_path

    path = resolve_model_path(f"tiny:{family}")
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    # exactly what Collage freezes with freeze_vision: vision tower, projector/connector, parameters never used
    model = prepare_policy(model, ModelSettings(path=f"tiny:{family}", dtype="float32", freeze_vision=True), False)
    samples = load_dataset(data).load_all()
    rows = [{"prompt": s.prompt, "images": s.images} for s in samples]
    dataset = datasets.Dataset.from_list(rows)
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t)

    common = dict(
        output_dir=tempfile.mkdtemp(),
        max_steps=steps,
        report_to="none",
        use_cpu=device == "cpu",
        bf16=False,
        gradient_checkpointing=False,
        save_strategy="no",
        logging_steps=1000,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        **SETTINGS,
    )
    if algorithm == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as T

        common["loss_type"] = "dapo"
        common["beta"] = 0.0
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as T

        common["beta"] = 0.0
    trainer = T(model=model, reward_funcs=[numeric_reward], args=Config(**common), train_dataset=dataset,
                processing_class=processor, callbacks=[Clock()])  # fmt: skip
    trainable = trainable_names(trainer.model)  # after TRL's own set-up, which must not unfreeze anything
    trainer.train()
    steady = times[2:] or times
    return {"seconds_per_step": sum(steady) / len(steady), "peak_mb": _peak_memory_mb(device), "trainable": trainable}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--family", default="qwen2-vl")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "ALGORITHM"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        framework, algorithm = args.child
        fn = run_collage if framework == "collage" else run_trl
        print("RESULT " + json.dumps(fn(algorithm, args.family, args.steps, args.device, args.data)))
        return

    from collage.training.data.synth import write_synth

    data = Path(tempfile.mkdtemp()) / "count-red"
    write_synth("count-red", data, rows=128, min_images=1, max_images=3, seed=0)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    results = {}
    for algorithm in ("grpo", "rloo"):
        for framework in ("collage", "trl"):
            cmd = [sys.executable, __file__, "--child", framework, algorithm, "--steps", str(args.steps),
                   "--family", args.family, "--device", args.device, "--data", str(data)]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"{framework} {algorithm} failed:\n{done.stderr[-3000:]}")
            results[(framework, algorithm)] = json.loads(line.removeprefix("RESULT "))
        collage, trl = results[("collage", algorithm)]["trainable"], results[("trl", algorithm)]["trainable"]
        if collage != trl:
            sys.exit(
                f"{algorithm}: the frameworks would train different parameters: only Collage "
                f"{sorted(set(collage) - set(trl))[:10]}, only TRL {sorted(set(trl) - set(collage))[:10]}"
            )
    s = SETTINGS
    print(f"{args.family}, {args.device}, {args.steps} steps (first 2 excluded), batch {s['per_device_train_batch_size']} "
          f"completions, {s['num_generations']} generations, max_completion_length {s['max_completion_length']}\n")  # fmt: skip
    print("| algorithm | Collage s/step | TRL s/step | ratio (TRL/Collage) | Collage peak MB | TRL peak MB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for algorithm in ("grpo", "rloo"):
        c, t = results[("collage", algorithm)], results[("trl", algorithm)]
        print(f"| {algorithm} | {c['seconds_per_step']:.3f} | {t['seconds_per_step']:.3f} | "
              f"{t['seconds_per_step'] / c['seconds_per_step']:.2f} | {c['peak_mb']:.0f} | {t['peak_mb']:.0f} |")  # fmt: skip
    trainable = results[("collage", "grpo")]["trainable"]
    print(f"\nTrained in both frameworks: the same {len(trainable)} parameter tensors (vision tower and projector "
          "frozen, names compared).")  # fmt: skip
    print("\nCollage step split (s): " + ", ".join(
        f"{a}: " + ", ".join(f"{k.removeprefix('timing/')} {v:.3f}" for k, v in results[("collage", a)].items() if k.startswith("timing/"))
        for a in ("grpo", "rloo")))  # fmt: skip


if __name__ == "__main__":
    main()
