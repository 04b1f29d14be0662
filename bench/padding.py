"""Prompt tokens a training step computes, and how many of them are padding: before and after the rollout engine.

Counts only, no model run: real prompts of a synthetic multi-image dataset encoded by a family's processor (its
real defaults), cut into generation batches and micro-batches exactly as the trainer does, with TRL's shuffle.

- **before**: generation prefilled every row (``G`` copies of each prompt); each micro-batch of the loss forward
  ran every row's prompt, padded to the longest prompt of the whole generation batch.
- **after**: generation prefills each distinct prompt once; micro-batches are regrouped within an optimizer step
  (``training.batching.buckets``), trimmed to their own longest prompt, and run each distinct prompt once
  (``training.batching.prefix``).

    .venv/bin/python bench/padding.py [--family qwen2-vl] [--images 0:3] [--batches 50]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from collage.training.batching.batch import collate
    from collage.training.batching.buckets import block_micro_batches, bucket_rows
    from collage.training.batching.encoding import PromptEncoder
    from collage.training.batching.prefix import prompt_groups
    from collage.training.data.loader import load_dataset
    from collage.training.data.synth import write_synth
    from collage.training.models.loading import load_processor, resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="qwen2-vl")
    parser.add_argument("--images", default="0:3", help="min:max images per row")
    parser.add_argument("--size", type=int, default=56, help="image side in pixels")
    parser.add_argument("--generations", type=int, default=4)
    parser.add_argument("--per-device", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--batches", type=int, default=50)
    args = parser.parse_args()
    low, high = (int(x) for x in args.images.split(":"))
    data = Path(tempfile.mkdtemp()) / "rows"
    write_synth("count-red", data, rows=256, min_images=low, max_images=high, seed=0, size=args.size)
    samples = load_dataset(str(data)).load_all()
    processor, family = load_processor(resolve_model_path(f"tiny:{args.family}"))
    encoder = PromptEncoder(processor, family)
    encoded = [encoder.encode(s) for s in samples]
    pad = processor.tokenizer.pad_token_id
    g, size, steps = args.generations, args.per_device, args.accumulation
    prompts_per_batch = size * steps // g
    rng = random.Random(0)
    torch.manual_seed(0)
    totals = {k: [0, 0] for k in ("generation before", "generation after", "loss before", "loss after")}

    def add(key: str, real: int, computed: int) -> None:
        totals[key][0] += real
        totals[key][1] += computed

    for _ in range(args.batches):
        distinct = rng.sample(encoded, prompts_per_batch)
        lengths = [len(p.input_ids) for p in distinct]
        longest = max(lengths)
        add("generation before", g * sum(lengths), g * len(distinct) * longest)
        add("generation after", sum(lengths), len(distinct) * longest)
        rows = [p for p in distinct for _ in range(g)]
        batch = collate(rows, family, pad)
        prompt_lengths = batch.attention_mask.sum(-1).tolist()
        order = torch.randperm(len(rows)).tolist()
        # before: TRL's shuffle, every row's prompt, padded to the generation batch's longest prompt
        add("loss before", sum(prompt_lengths), len(rows) * longest)
        block = block_micro_batches(steps, steps) * size
        bucketed = bucket_rows(order, prompt_lengths, [i // g for i in range(len(rows))], [0] * len(rows), block)
        shuffled = batch.select(bucketed, family.layout)
        for lo in range(0, len(rows), size):
            mb = shuffled.slice(lo, lo + size, family.layout).trimmed()
            groups = prompt_groups(mb)
            assert groups is not None
            firsts = groups[0]
            real = int(mb.attention_mask[firsts].sum())
            add("loss after", real, len(firsts) * mb.prompt_length)
    print(f"{args.family}, rows of {low}..{high} images of {args.size} px, G={g}, {size} rows a micro-batch, "
          f"{steps} micro-batches a generation batch, {args.batches} generation batches\n")  # fmt: skip
    print("| pass | prompt tokens computed per generation batch | of which padding |")
    print("| --- | ---: | ---: |")
    for key, (real, computed) in totals.items():
        print(f"| {key} | {computed / args.batches:.0f} | {100 * (1 - real / computed):.1f}% |")


if __name__ == "__main__":
    main()
