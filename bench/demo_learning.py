"""Does the demo learn its task? Held-out accuracy of the demo run, against the image-blind baseline.

Runs ``collage train`` on the demo config (``examples/grpo-count-red.yaml``: GRPO, tiny Qwen2-VL with random
weights, synthetic count-red with 1..3 images per row) with a pinned thread count, and reads its output folder:

- ``eval/rewards/accuracy/mean`` at every evaluation (greedy, on held-out rows: the task's ``eval`` split, another
  seed, never trained on), from step 0 (before any update) to the end;
- the best **image-blind** accuracy on those same rows: always answering their most frequent count (what a policy
  that ignores its images can reach at best; chance for a uniform guess over 0..3 is lower);
- accuracy by image count, wall and CPU time of the run.

It writes ``docs/demo-accuracy.png`` (the chart in the README) and ``docs/demo-accuracy.json`` (the numbers).
Several seeds (``--seeds 0,1,2``) show the spread.

    .venv/bin/python -m bench.demo_learning [--seeds 0] [--threads 2] [--config examples/grpo-count-red.yaml]
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
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCURACY = "eval/rewards/accuracy/mean"


def run_demo(config: Path, seed: int, threads: int, out: Path) -> dict:
    """One demo run in a subprocess (a fresh COLLAGE_HOME per run: its tiny model and dataset are built inside)."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "COLLAGE_HOME": str(out / "home")}  # fmt: skip
    command = [sys.executable, "-m", "collage.app.cli", "train", str(config), "--out", str(out / "run"),
               "--set", f"train.seed={seed}"]  # fmt: skip
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return summarise(out / "run", seed, wall, cpu)


def summarise(run: Path, seed: int, wall: float, cpu: float) -> dict:
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    curve = [(m["step"], m[ACCURACY]) for m in metrics if ACCURACY in m]
    by_images = {
        k.split("/")[2]: v for k, v in next(m for m in reversed(metrics) if ACCURACY in m).items() if "by_images" in k
    }
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    first_eval = [s for s in samples if s.get("split") == "eval" and s["step"] == curve[0][0]]
    answers = Counter(str(s["columns"]["answer"]) for s in first_eval)
    blind_answer, blind_hits = answers.most_common(1)[0]
    return {
        "seed": seed,
        "eval_rows": len(first_eval),
        "curve": curve,
        "start": curve[0][1],
        "end": curve[-1][1],
        "best": max(a for _, a in curve),
        "blind_baseline": blind_hits / len(first_eval),
        "blind_answer": blind_answer,
        "uniform_guess": sum(answers[str(k)] / (4 * len(first_eval)) for k in range(4)),
        "final_reward_by_images": by_images,
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
    }


def chart(results: list[dict], path: Path) -> None:
    """Accuracy per step for each seed, and the image-blind baseline."""
    from bench.charts import Series, line_chart

    series = [Series(f"seed {r['seed']}", r["curve"]) for r in results]
    blind = max(r["blind_baseline"] for r in results)
    line_chart(series, path, "optimizer step (held-out accuracy, greedy)", [("image-blind best", blind)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "grpo-count-red.yaml")
    parser.add_argument("--seeds", default="0", help="comma-separated training seeds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (pinned)")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the chart and numbers go")
    args = parser.parse_args()
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            result = run_demo(args.config.resolve(), seed, args.threads, Path(tmp))
        results.append(result)
        print(f"seed {seed}: held-out accuracy {result['start']:.3f} at step 0 -> {result['end']:.3f} at the end "
              f"(best {result['best']:.3f}; image-blind best {result['blind_baseline']:.3f} answering "
              f"{result['blind_answer']!r}; {result['eval_rows']} rows), wall {result['wall_s']} s, "
              f"CPU {result['cpu_s']} s")  # fmt: skip
    args.docs.mkdir(parents=True, exist_ok=True)
    (args.docs / "demo-accuracy.json").write_text(json.dumps(results, indent=1) + "\n")
    chart(results, args.docs / "demo-accuracy.png")
    print(f"wrote {args.docs / 'demo-accuracy.png'} and {args.docs / 'demo-accuracy.json'}")


if __name__ == "__main__":
    main()
