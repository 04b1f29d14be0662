"""CPU time, wall time and peak memory per training step: Collage vs TRL's GRPOTrainer, same everything.

Method (what makes the comparison fair):

- **Same work.** Same random-weight model (``bench/models.py``), same synthetic multi-image rows (``count-red``,
  exactly ``k`` images per row: TRL's GRPO refuses text-only rows), same settings (``SETTINGS``: 16 completions a
  step, ``num_generations`` G, ``loss_type: dapo``, ``beta: 0``, temperature 1, top-k/top-p off, learning rate,
  seed), same reward function. Both train exactly the same parameters: TRL's model is frozen by the function
  Collage uses for ``model.freeze_vision`` (vision tower and projector), and a run stops unless both report the same
  trainable names.
- **Interleaved A/B pairs.** Each repetition runs Collage then TRL, or TRL then Collage (alternating), each in a
  fresh process, so drift of the machine hits both sides alike.
- **One pinned thread.** ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)`` in every run: CPU time is then the
  work done, not how well a framework fills the cores.
- **Per step:** CPU time (``time.process_time``) and wall time, warm-up steps excluded; each run reports its
  median step, and the table gives the median (and min) of those over the repetitions. Peak memory: the process's
  peak RSS over the whole run, and its rise during training (the kernel's ``VmHWM``, reset right before the first
  step) which leaves out imports and the model load. ``images encoded``: images through the vision tower per step,
  counted by a hook on the tower in both frameworks.

    .venv/bin/python bench/train_vs_trl.py                      # the full matrix (about an hour on 2 cores)
    .venv/bin/python bench/train_vs_trl.py --cases mid:3:8 --reps 3
    .venv/bin/python bench/train_vs_trl.py --cases vocab:3:8:128 --reps 2

A case is ``model:images:G[:completion_length]`` (``model`` from ``bench/models.py``). docs/benchmarks.md keeps
the results.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("COLLAGE_BENCH_CACHE", Path.home() / ".cache" / "collage" / "bench"))
SETTINGS = dict(per_device_train_batch_size=16, learning_rate=1e-4, temperature=1.0, seed=0)
IMAGE_PX = {"tiny": 56, "mid": 168, "vocab": 168}
COMPLETION = {"tiny": 24, "mid": 32, "vocab": 128}
MATRIX = [f"{m}:{k}:{g}" for m in ("tiny", "mid") for k in (1, 3, 6) for g in (4, 8)] + [
    f"vocab:3:8:{c}" for c in (32, 64, 128)
]


@dataclass(frozen=True)
class Case:
    model: str
    images: int
    generations: int
    completion: int

    @classmethod
    def parse(cls, text: str) -> Case:
        parts = text.split(":")
        if len(parts) not in (3, 4):
            raise SystemExit(f"case {text!r}: use model:images:G[:completion_length]")
        model, images, g = parts[0], int(parts[1]), int(parts[2])
        completion = int(parts[3]) if len(parts) == 4 else COMPLETION[model]
        return cls(model, images, g, completion)

    def __str__(self) -> str:
        return f"{self.model}:{self.images}:{self.generations}:{self.completion}"


def numeric_reward(completions, **kwargs):
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        chars = [ch for ch in text if not ch.isspace()]
        out.append(sum(ch.isdigit() for ch in chars) / len(chars) if chars else 0.0)
    return out


# ------------------------------------------------------------------------------------------------ one run


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


class Meter:
    """Step boundaries (CPU and wall clocks), images through the vision tower, and the training memory rise."""

    def __init__(self, model) -> None:
        self.cpu: list[float] = []
        self.wall: list[float] = []
        self.images: list[int] = []
        self.encoded = 0
        visual = model.get_base_model().model.visual if hasattr(model, "get_base_model") else model.model.visual
        visual.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        self.encoded += int(grid.shape[0])

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak RSS (VmHWM) to the current RSS
        self.base_rss = _status_bytes("VmRSS:")
        self.mark()

    def mark(self) -> None:
        self._cpu, self._wall, self._encoded = time.process_time(), time.perf_counter(), self.encoded

    def step(self) -> None:
        self.cpu.append(time.process_time() - self._cpu)
        self.wall.append(time.perf_counter() - self._wall)
        self.images.append(self.encoded - self._encoded)
        self.mark()

    def result(self, warmup: int, trainable: list[str], params: int) -> dict:
        keep = slice(warmup, None) if len(self.cpu) > warmup else slice(None)
        return {
            "cpu": statistics.median(self.cpu[keep]),
            "wall": statistics.median(self.wall[keep]),
            "images_encoded": statistics.median(self.images[keep]),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "train_rise_mb": (_status_bytes("VmHWM:") - self.base_rss) / 2**20,
            "trainable": trainable,
            "parameters": params,
        }


def _trainable(model) -> list[str]:
    return sorted(name for name, p in model.named_parameters() if p.requires_grad)


def run_collage(case: Case, model_dir: str, data: str, steps: int, warmup: int) -> dict:
    from collage.training.callbacks import Callback
    from collage.training.config import parse_config
    from collage.training.trainer import Trainer

    train = {**SETTINGS, "num_generations": case.generations, "max_completion_length": case.completion,
             "max_steps": steps, "max_prompt_length": 1024, "beta": 0.0, "loss_type": "dapo"}  # fmt: skip
    config = parse_config(
        {
            "algorithm": "grpo",
            "model": {"path": model_dir, "dtype": "float32", "freeze_vision": True},
            "dataset": {"source": data},
            "rewards": [{"name": "bench.train_vs_trl:numeric_reward"}],
            "train": train,
            "logging": {"samples_every": 0},
            "resources": {"gpus": 0},
        }
    )
    meter: Meter | None = None

    class Steps(Callback):
        def on_metrics(self, step, metrics):
            assert meter is not None
            meter.step()

    trainer = Trainer(config, None, [Steps()])
    trainer.setup()
    model = trainer.accelerator.unwrap_model(trainer.model)
    meter = Meter(model)
    meter.start()
    trainer.train()
    return meter.result(warmup, _trainable(model), sum(p.numel() for p in model.parameters()))


def run_trl(case: Case, model_dir: str, data: str, steps: int, warmup: int) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from collage.training.config import ModelSettings
    from collage.training.data.loader import load_dataset
    from collage.training.modeling import prepare_policy

    processor = AutoProcessor.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    # exactly what Collage freezes with freeze_vision: vision tower, projector, parameters never used
    model = prepare_policy(model, ModelSettings(path=model_dir, dtype="float32", freeze_vision=True), False)
    rows = [{"prompt": s.prompt, "images": s.images} for s in load_dataset(data).load_all()]
    meter = Meter(model)

    class Steps(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            meter.mark()

        def on_step_end(self, args, state, control, **kw):
            meter.step()

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), max_steps=steps, report_to="none", use_cpu=True, bf16=False,
                      gradient_checkpointing=False, save_strategy="no", logging_steps=1000, max_grad_norm=1.0,
                      lr_scheduler_type="linear", num_generations=case.generations,
                      max_completion_length=case.completion, loss_type="dapo", beta=0.0, **SETTINGS)  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[numeric_reward], args=args,
                          train_dataset=datasets.Dataset.from_list(rows), processing_class=processor,
                          callbacks=[Steps()])  # fmt: skip
    trainable = _trainable(trainer.model)  # after TRL's own set-up, which must not unfreeze anything
    meter.start()
    trainer.train()
    return meter.result(warmup, trainable, sum(p.numel() for p in model.parameters()))


def child(framework: str, case: Case, model_dir: str, data: str, steps: int, warmup: int) -> None:
    import torch

    torch.set_num_threads(1)
    fn = run_collage if framework == "collage" else run_trl
    print("RESULT " + json.dumps(fn(case, model_dir, data, steps, warmup)))


# ------------------------------------------------------------------------------------------------ driver


def _data(case: Case) -> Path:
    from collage.training.data.synth import write_synth

    out = CACHE / f"data-{case.images}img-{IMAGE_PX[case.model]}px"
    if not (out / "train.jsonl").exists() and not any(out.glob("*.jsonl")):
        write_synth("count-red", out, rows=64, min_images=case.images, max_images=case.images, seed=0,
                    size=IMAGE_PX[case.model])  # fmt: skip
    return out


def _run(framework: str, case: Case, model_dir: Path, data: Path, steps: int, warmup: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # fmt: skip
    cmd = [sys.executable, __file__, "--child", framework, "--cases", str(case), "--model-dir", str(model_dir),
           "--data", str(data), "--steps", str(steps), "--warmup", str(warmup)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        sys.exit(f"{framework} {case} failed:\n{done.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def _fmt(values: list[float], digits: int = 3) -> str:
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=MATRIX, help="model:images:G[:completion_length]")
    parser.add_argument("--reps", type=int, default=3, help="A/B pairs per case")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write every run's figures here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, Case.parse(args.cases[0]), args.model_dir, args.data, args.steps, args.warmup)
        return

    sys.path.insert(0, str(ROOT))
    import torch
    import transformers
    import trl

    from bench.models import model_path

    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, TRL {trl.__version__}; one thread; "
          f"{args.reps} A/B pairs per case, {args.steps} steps a run, first {args.warmup} excluded; "
          f"{SETTINGS['per_device_train_batch_size']} completions a step\n")  # fmt: skip
    print("| case (model:images:G:C) | params | Collage CPU s/step | TRL CPU s/step | CPU ratio | wall ratio | "
          "peak RSS MB (C / T) | training rise MB (C / T) | images encoded (C / T) |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    everything = {}
    for text in args.cases:
        case = Case.parse(text)
        model_dir, data = model_path(case.model, CACHE), _data(case)
        runs: dict[str, list[dict]] = {"collage": [], "trl": []}
        for rep in range(args.reps):
            order = ("collage", "trl") if rep % 2 == 0 else ("trl", "collage")
            for framework in order:
                runs[framework].append(_run(framework, case, model_dir, data, args.steps, args.warmup))
        c, t = runs["collage"], runs["trl"]
        if c[0]["trainable"] != t[0]["trainable"]:
            sys.exit(f"{case}: the frameworks would train different parameters")
        ccpu, tcpu = [r["cpu"] for r in c], [r["cpu"] for r in t]
        cwall, twall = [r["wall"] for r in c], [r["wall"] for r in t]
        med = statistics.median
        print(f"| {case} | {c[0]['parameters'] / 1e6:.1f}M | {_fmt(ccpu)} | {_fmt(tcpu)} | "
              f"{med(ccpu) / med(tcpu):.2f} | {med(cwall) / med(twall):.2f} | "
              f"{med(r['peak_rss_mb'] for r in c):.0f} / {med(r['peak_rss_mb'] for r in t):.0f} | "
              f"{med(r['train_rise_mb'] for r in c):.0f} / {med(r['train_rise_mb'] for r in t):.0f} | "
              f"{med(r['images_encoded'] for r in c):.0f} / {med(r['images_encoded'] for r in t):.0f} |",
              flush=True)  # fmt: skip
        everything[str(case)] = {
            k: [{x: y for x, y in r.items() if x != "trainable"} for r in v] for k, v in runs.items()
        }
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1))
    print("\nCPU ratio, wall ratio: Collage / TRL (medians over the pairs); s/step: median (min) over the pairs of "
          "each run's median step. Trained parameters compared by name in every case.")  # fmt: skip


if __name__ == "__main__":
    main()
