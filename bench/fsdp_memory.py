"""What FSDP2 saves per process: peak RSS, the shards' sizes and the step time of DDP vs FSDP2 on two CPU processes.

The model is a random-weight Qwen2-VL whose language model has Qwen2-VL-2B's layer shape (hidden 1536, MLP 8960,
12 heads, 2 key/value heads) and 4 layers, with the tiny processor (about 190M parameters): large enough that the
model's state dominates each process's memory on this machine. Each strategy runs ``collage train`` on two gloo
processes (``accelerate launch``, one thread each, the same seed, data and settings: GRPO with a KL term, so the
reference is held too), interleaved DDP, FSDP2, DDP, FSDP2 for ``--repeats`` pairs. Per run it records each
process's peak RSS (``ru_maxrss``, read at the process's exit), the median step time of the steps after the first,
and the checkpoint's sizes (the sharded checkpoint's shard per process against the DDP checkpoint's model and
optimizer state); ``collage plan``'s prediction for each strategy is set beside them.

    .venv/bin/python -m bench.fsdp_memory [--repeats 2] [--steps 3] [--profile]

``--profile`` adds one DDP/FSDP2 pair under cProfile (apart from the timed pairs): rank 0's own time by function,
and by category (gloo collectives, FSDP2's bookkeeping), to say where FSDP2's extra step time goes.

It writes ``docs/fsdp-memory.json``; docs/benchmarks.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = {"hidden_size": 1536, "intermediate_size": 8960, "num_attention_heads": 12, "num_key_value_heads": 2,
         "num_hidden_layers": 4}  # fmt: skip
PROBE = """import atexit, json, os, resource, sys
_profile = None
if os.environ.get("COLLAGE_BENCH_PROFILE") and os.environ.get("RANK") is not None:
    import cProfile
    _profile = cProfile.Profile()
    _profile.enable()
def _record():
    rank = os.environ.get("RANK")
    if rank is not None:
        with open(os.path.join(os.environ["COLLAGE_BENCH_RSS"], "rank-" + rank), "w") as fh:
            fh.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))
        if _profile is not None:
            _profile.disable()
            _profile.dump_stats(os.path.join(os.environ["COLLAGE_BENCH_PROFILE"], "rank-" + rank + ".prof"))
atexit.register(_record)
_exit = os._exit
def _recorded_exit(code):
    _record()
    _exit(code)
os._exit = _recorded_exit
"""


def build_model(dest: Path, home: Path) -> Path:
    """The benchmark's model folder: tiny Qwen2-VL's processor, a language model of Qwen2-VL-2B's layer shape."""
    os.environ["COLLAGE_HOME"] = str(home)
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    from collage.training.models.loading import resolve_model_path

    tiny = resolve_model_path("tiny:qwen2-vl")
    config = AutoConfig.from_pretrained(tiny)
    for key, value in SHAPE.items():
        setattr(config.text_config, key, value)
    config.text_config.layer_types = ["full_attention"] * SHAPE["num_hidden_layers"]
    # Qwen2-VL-2B's rotary sections for its head size (128: 64 rotary pairs in t, h, w)
    config.text_config.rope_parameters = {**config.text_config.rope_parameters, "mrope_section": [16, 24, 24]}
    config.vision_config.hidden_size = SHAPE["hidden_size"]  # the merger's output is the language model's width
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest)
    AutoProcessor.from_pretrained(tiny).save_pretrained(dest)
    return dest


def run_config(model: Path, strategy: str, steps: int) -> dict:
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "dataset": {"source": "synth:count-red", "rows": 32, "min_images": 1, "max_images": 2},
        "rewards": [{"name": "numeric"}, {"name": "accuracy"}],
        "train": {"max_steps": steps, "learning_rate": 1e-5, "beta": 0.04, "per_device_train_batch_size": 4,
                  "num_generations": 4, "max_prompt_length": 256, "max_completion_length": 8, "seed": 3},
        "resources": {"gpus": 0, "processes": 2, "strategy": strategy},
    }  # fmt: skip


def run_once(work: Path, model: Path, strategy: str, steps: int, tag: str, profile: bool = False) -> dict:
    import yaml

    cfg = work / f"{tag}.yaml"
    cfg.write_text(yaml.safe_dump(run_config(model, strategy, steps)))
    out, rss = work / f"out-{tag}", work / f"rss-{tag}"
    rss.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "COLLAGE_BENCH_RSS": str(rss),
           "PYTHONPATH": f"{work / 'probe'}{os.pathsep}{ROOT}", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    if profile:
        env["COLLAGE_BENCH_PROFILE"] = str(rss)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "-m", "collage.app.cli", "train", str(cfg), "--out", str(out), "--quiet"]  # fmt: skip
    subprocess.run(cmd, env=env, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = {
        "strategy": strategy,
        "peak_rss": sorted(int(f.read_text()) for f in rss.glob("rank-?")),
        "step_time": statistics.median(m["step_time"] for m in metrics[1:]),
        # where a step's time goes, by the trainer's own timers (median over the steps after the first)
        "timing": {k: statistics.median(m[k] for m in metrics[1:]) for k in metrics[-1] if k.startswith("timing/")},
        "checkpoint": checkpoint_sizes(out / "checkpoints" / f"step-{steps}"),
    }
    if profile:
        result["profile"] = profile_summary(rss / "rank-0.prof")
    return result


# what a profile's functions are, by where they come from (the categories docs/benchmarks.md compares)
CATEGORIES = {
    "collectives (gloo)": ("distributed_c10d.py", "_functional_collectives", "_fsdp_collectives", "c10d"),
    "FSDP2 bookkeeping": ("_fsdp_param", "_fsdp_param_group", "_fsdp_state", "_fully_shard"),
    "autograd backward": ("run_backward", "_engine_run_backward"),
}


def profile_summary(path: Path, top: int = 15) -> dict:
    """Rank 0's profile: the functions with the most time of their own, and the time of each category."""
    import pstats

    stats = pstats.Stats(str(path))
    rows = [(f"{Path(file).name}:{line}({name})", tottime, cumtime)
            for (file, line, name), (_, _, tottime, cumtime, _) in stats.stats.items()]  # type: ignore[attr-defined]  # fmt: skip
    rows.sort(key=lambda r: r[1], reverse=True)
    categories = {c: round(sum(t for f, t, _ in rows if any(m in f for m in marks)), 2)
                  for c, marks in CATEGORIES.items()}  # fmt: skip
    return {"total_s": round(sum(t for _, t, _ in rows), 2), "own_time_by_category_s": categories,
            "top_own_time": [{"function": f, "own_s": round(t, 2), "cumulative_s": round(c, 2)}
                             for f, t, c in rows[:top]]}  # fmt: skip


def checkpoint_sizes(folder: Path) -> dict:
    """What one process holds of the model and the optimizer state, as the checkpoint writes it."""
    if (folder / "shards.json").is_file():
        files = json.loads((folder / "shards.json").read_text())["files"]
        return {"per_process": sorted(f["bytes"] for f in files if f["path"].endswith(".distcp"))}
    model = sum(f.stat().st_size for f in (folder / "model").glob("*.safetensors"))
    return {"per_process": [model + (folder / "trainer_state.pt").stat().st_size] * 2}


def predictions(model: Path, steps: int) -> dict:
    from collage.training.config import parse_config
    from collage.training.memory_plan import make_plan

    plan = make_plan(parse_config(run_config(model, "ddp", steps)), 2)
    return {"parameters": plan.model.parameters, **{f.strategy: f.peak for f in plan.strategies}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "fsdp-memory.json")
    parser.add_argument("--profile", action="store_true",
                        help="one more DDP/FSDP2 pair under cProfile (rank 0's own time by function and category)")  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="collage-fsdp-bench-") as tmp:
        work = Path(tmp)
        (work / "probe").mkdir()
        (work / "probe" / "sitecustomize.py").write_text(PROBE)
        os.environ["COLLAGE_HOME"] = str(work / "home")  # the runs' children inherit it
        model = build_model(work / "model", work / "home")
        runs = [run_once(work, model, s, args.steps, f"{s}-{r}") for r in range(args.repeats) for s in ("ddp", "fsdp")]
        result = {"shape": SHAPE, "steps": args.steps, "plan": predictions(model, args.steps), "runs": runs}
        if args.profile:  # apart from the timed runs: the profiler slows the Python side down
            result["profiled"] = [run_once(work, model, s, args.steps, f"{s}-profiled", profile=True)
                                  for s in ("ddp", "fsdp")]  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))
    for run in runs:
        print(run["strategy"], [f"{b / 2**30:.2f} GiB" for b in run["peak_rss"]], f"{run['step_time']:.2f} s",
              [f"{b / 2**20:.0f} MiB" for b in run["checkpoint"]["per_process"]])  # fmt: skip


if __name__ == "__main__":
    main()
