"""The zoom example, honestly: what a tiny random model does with the zoom tool, and the mechanics with a script.

Three runs of ``examples/grpo-zoom.yaml`` (GRPO on ``synth:find-digit``, tiny Qwen2-VL with random weights, the
``image_zoom_in`` tool), each through ``collage train``'s own Trainer with pinned threads:

1. **as shipped**: the example config, ``--steps`` optimizer steps;
2. **with shaping**: the same plus ``numeric`` at weight 0.25 (pays bare integers), so some reward varies within a
   group and the policy has a gradient at all;
3. **scripted** (the mechanics): sampling replaced by a script (each group's four rollouts zoom into the four
   quadrants of the image, then answer ``<answer>1</answer>``; ``max_completion_length`` 512 so that a 320 px crop's
   image tokens fit the rollout's budget); everything else is real (the turn loop, the tool,
   the crops, the rewards, the loss on the generated tokens, the metrics). Exactly one quadrant holds the digit's
   centre, so ``zoom_hit`` tells the rollouts of a group apart.

It reads each run's ``metrics.jsonl`` and writes ``docs/zoom-demo.json`` (the numbers) and ``docs/zoom-demo.png``
(tool-call rate in training and held-out accuracy per step, for runs 1 and 2).

    .venv/bin/python -m bench.zoom_demo [--steps 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "grpo-zoom.yaml"
KEYS = ("reward", "tools/call_frequency", "tools/used_fraction", "rewards/format/mean", "rewards/numeric/mean",
        "rewards/accuracy/mean", "rewards/zoom_hit/mean", "frac_reward_zero_std", "completions/mean_length",
        "loss", "turns/mean", "images/added_mean")  # fmt: skip
EVAL_KEYS = ("eval/rewards/accuracy/mean", "eval/tools/call_frequency", "eval/reward")
SHAPED = (
    "[{name: accuracy, weight: 1.0}, {name: format, weight: 0.25}, {name: tool_format, weight: 0.25}, "
    "{name: tool_bonus, weight: 0.5}, {name: zoom_hit, weight: 0.0}, {name: numeric, weight: 0.25}]"
)
QUADRANTS = ([0, 0, 320, 320], [320, 0, 640, 320], [0, 320, 320, 640], [320, 320, 640, 640])


def env(threads: int, home: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "COLLAGE_HOME": str(home)}  # fmt: skip


def run_cli(out: Path, threads: int, steps: int, extra: list[str]) -> tuple[float, float]:
    command = [sys.executable, "-m", "collage.app.cli", "train", str(CONFIG), "--out", str(out / "run"),
               "--set", f"train.max_steps={steps}", *extra]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env(threads, out / "home"), check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return time.perf_counter() - start, cpu


def scripted_run(out: Path, threads: int, steps: int) -> tuple[float, float]:
    """Run 3 in a child (the script replaces ``training.generation.BACKENDS["hf"]`` there only)."""
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from bench.zoom_demo import _scripted; " \
           f"_scripted({str(out / 'run')!r}, {steps})"  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], env=env(threads, out / "home"), check=True, stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return time.perf_counter() - start, cpu


def _scripted(out: str, steps: int) -> None:
    from collage.training import generation
    from collage.training.config import load_config
    from collage.training.generation import Completions
    from collage.training.output import OutputFolder
    from collage.training.trainer import Trainer

    def script(model, batch, g, family, tokenizer, image_token_id, protected, max_new, sampling, features=None,
               **_):  # fmt: skip
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        rows = []
        for i in range(batch.batch_size * g):
            if "<tool_response>" in tokenizer.decode(batch.input_ids[i // g]):
                text = "<answer>1</answer>"
            else:
                box = QUADRANTS[i % len(QUADRANTS)]
                call = {"name": "image_zoom_in", "arguments": {"bbox_2d": box}}
                text = f"<tool_call>{json.dumps(call)}</tool_call>"
            rows.append(tokenizer.encode(text, add_special_tokens=False)[: max_new - 1] + [eos])
        return Completions(rows, [False] * len(rows))

    generation.BACKENDS["hf"] = script
    # a 320 px quadrant is about 130 image tokens on the tiny Qwen2-VL: the rollout's budget must hold it
    overrides = [f"train.max_steps={steps}", "train.eval_steps=5", "train.save_steps=1000",
                 "train.max_completion_length=512"]  # fmt: skip
    config = load_config(CONFIG, overrides)
    Trainer(config, Path(out), [OutputFolder(Path(out))]).train()


def summarise(run: Path, wall: float, cpu: float) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def clean(v):
        return None if isinstance(v, float) and math.isnan(v) else v

    train = [{"step": m["step"], **{k: clean(m[k]) for k in KEYS if k in m}} for m in metrics if "reward" in m]
    evals = [{"step": m["step"], **{k: clean(m[k]) for k in EVAL_KEYS if k in m}} for m in metrics if EVAL_KEYS[0] in m]
    return {"train": train, "eval": evals, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


def chart(results: dict, path: Path) -> None:
    from bench.charts import Series, line_chart

    series = []
    for name in ("as shipped", "with shaping"):
        r = results[name]
        series.append(
            Series(f"{name}: tool calls / rollout", [(m["step"], m["tools/call_frequency"]) for m in r["train"]])
        )
        series.append(Series(f"{name}: held-out accuracy", [(m["step"], m[EVAL_KEYS[0]]) for m in r["eval"]]))
    shaped = results["with shaping"]["train"]
    series.append(
        Series("with shaping: numeric reward", [(m["step"], m.get("rewards/numeric/mean") or 0.0) for m in shaped])
    )
    line_chart(series, path, "optimizer step (train: per step; held-out: greedy)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--scripted-steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (pinned)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args()
    results = {}
    runs = {
        "as shipped": lambda out: run_cli(out, args.threads, args.steps, []),
        "with shaping": lambda out: run_cli(out, args.threads, args.steps, ["--set", f"rewards={SHAPED}"]),  # fmt: skip
        "scripted": lambda out: scripted_run(out, args.threads, args.scripted_steps),
    }
    for name, go in runs.items():
        with tempfile.TemporaryDirectory() as tmp:
            wall, cpu = go(Path(tmp))
            results[name] = summarise(Path(tmp) / "run", wall, cpu)
        last = results[name]["train"][-1]
        print(f"{name}: wall {wall:.0f} s, CPU {cpu:.0f} s; last step {json.dumps(last)}")
        print(f"  held-out: {json.dumps(results[name]['eval'])}")
    args.docs.mkdir(parents=True, exist_ok=True)
    (args.docs / "zoom-demo.json").write_text(json.dumps(results, indent=1) + "\n")
    chart(results, args.docs / "zoom-demo.png")
    print(f"wrote {args.docs / 'zoom-demo.png'} and {args.docs / 'zoom-demo.json'}")


if __name__ == "__main__":
    main()
