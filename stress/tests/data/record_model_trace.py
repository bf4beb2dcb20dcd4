#!/usr/bin/env python3
r"""Records allocation traces of small real transformers models on the CPU, as stepalloc JSON lines.

The models are built from configs with random weights (nothing is downloaded). Every tensor
allocation and free is taken from the PyTorch profiler (`profile_memory=True`: each memory event
carries the address and the bytes, negative for a free), sorted by time, and written in the
format of `stress/src/trace/jsonl.rs`:

    {"op":"alloc","addr":A,"size":S,"t_us":T}   {"op":"free","addr":A,"t_us":T}
    {"op":"step_begin","phase":P}                {"op":"step_end"}

Step markers come from `record_function("stepalloc_step:<phase>")` ranges around every loop
iteration. The profiler starts before the model is built, so weights and optimizer state are in
the trace. Frees of addresses allocated before recording and zero-byte allocations are dropped.

Workloads (`--workload`):
  sft        a small Llama-style LM, supervised fine-tuning with variable sequence lengths
             (padded batches of random length), AdamW, a no-grad evaluation step every few steps;
  vlm-agent  a CLIP vision tower + projector + Llama-style LM: rollouts that generate under
             torch.no_grad with HF's growing KV cache (DynamicCache), 1-3 images per episode,
             alternating with training steps on the generated episodes; `--train-vision` trains
             the vision tower too (frozen by default).

Usage (from the repository root; each trace is kept under 2 MB). The checked-in traces were
recorded with these exact commands, sized so that each floor (peak live bytes) is 2-5 GiB and
2 MiB pages do not dominate the comparisons, with the same numbers of layers and steps (hence
about the same number of events) as the defaults:
    python3 stress/tests/data/record_model_trace.py --workload sft --hidden 1280 --vocab 32000 \
        --out stress/tests/data/model_llama_sft.jsonl
    python3 stress/tests/data/record_model_trace.py --workload vlm-agent --hidden 1536 --vocab 32000 \
        --vision-hidden 768 --out stress/tests/data/model_vlm_agent.jsonl
    python3 stress/tests/data/record_model_trace.py --workload vlm-agent --train-vision --hidden 1536 \
        --vocab 32000 --vision-hidden 768 --out stress/tests/data/model_vlm_agent_trained_vision.jsonl
Their floors: 2.75 GiB (sft, 12.9k allocations, 1.5 MB), 2.86 GiB (vlm-agent, 15.4k, 1.8 MB) and
3.10 GiB (trained vision, 17.0k, 1.97 MB); on two CPU cores they took 163 s, 75 s and 78 s of
CPU time (3.5, 1.7 and 1.8 min wall) and at most 6.2, 4.7 and 4.8 GB of RAM. The script prints
the counts and the peak live bytes (= the replay's 'peak requested (floor)') to stderr.

Defaults (small: floors of 0.37-0.48 GiB): sft = 12 steps of batch 4 (lengths log-normal around
150 tokens, at most 512) with an eval step every 4, Llama hidden 512 x 4 layers, vocab 8192;
vlm-agent = 2 iterations of a rollout of 3 episodes (1-3 images of 224 px, up to 16 generated
tokens) and a training step, CLIP 256 x 2 layers, Llama hidden 512 x 2 layers. About 20 s each on
two CPU cores. Size options: --hidden (Llama; MLP 11/4 of it, 8 heads, 4 KV heads), --vocab,
--batch, --max-len, --max-new, --vision-hidden (CLIP; MLP 4x, heads hidden/64, at least 4),
--image-size; --layers, --vision-layers and --steps change the number of events.

Same seed, same shapes; addresses and times differ between runs (they come from the CPU's
allocator), which does not change a replay's figures beyond the order of equal-time events.
"""

import argparse
import json
import random
import sys

import torch
from torch.profiler import ProfilerActivity, profile, record_function

MARK = "stepalloc_step:"


def llama(vocab, hidden, layers, heads, kv_heads, intermediate):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def clip_vision(hidden, layers, heads, intermediate, image, patch):
    from transformers import CLIPVisionConfig, CLIPVisionModel

    cfg = CLIPVisionConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        image_size=image,
        patch_size=patch,
    )
    return CLIPVisionModel(cfg)


def sft(args, rng):
    """Supervised fine-tuning with variable lengths; an eval step every `eval_every` steps."""
    model = llama(args.vocab, args.hidden, args.layers, 8, 4, args.hidden * 11 // 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(args.steps):
        batch = args.batch
        length = min(args.max_len, max(16, int(rng.lognormvariate(mu=5.0, sigma=0.6))))
        ids = torch.randint(0, args.vocab, (batch, length))
        with record_function(MARK + "train"):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            del out
        if args.eval_every and (step + 1) % args.eval_every == 0:
            with record_function(MARK + "eval"), torch.no_grad():
                length = min(args.max_len, max(16, int(rng.lognormvariate(mu=5.3, sigma=0.4))))
                ids = torch.randint(0, args.vocab, (batch * 2, length))
                out = model(input_ids=ids, labels=ids)
                del out
        del ids


def vlm_agent(args, rng):
    """Rollouts (generation under no_grad, KV cache growing token by token) alternating with
    training on the episodes; images go through a CLIP tower and a projector into the LM."""
    image, patch = args.image_size, 16
    vh = args.vision_hidden
    vision = clip_vision(vh, args.vision_layers, max(4, vh // 64), vh * 4, image, patch)
    lm = llama(args.vocab, args.hidden, args.layers, 8, 4, args.hidden * 11 // 4)
    proj = torch.nn.Linear(vh, args.hidden)
    trained = list(lm.parameters()) + list(proj.parameters())
    if args.train_vision:
        trained += list(vision.parameters())
    else:
        vision.requires_grad_(False)
    opt = torch.optim.AdamW(trained, lr=1e-4)
    embed = lm.get_input_embeddings()

    def episode_embeds(images, prompt_len, grad):
        pixels = torch.randn(images, 3, image, image)
        with torch.set_grad_enabled(grad and args.train_vision):
            feats = vision(pixel_values=pixels).last_hidden_state  # images x tokens x vision_hidden
        with torch.set_grad_enabled(grad):
            img = proj(feats).reshape(1, -1, args.hidden)
            ids = torch.randint(0, args.vocab, (1, prompt_len))
            return torch.cat([img, embed(ids)], dim=1)

    for _ in range(args.steps):
        # Rollout: a batch of episodes, each with 1-3 images and a prompt, answered by sampling.
        episodes = []
        with record_function(MARK + "rollout"), torch.no_grad():
            for _ in range(args.batch):
                images = rng.randint(1, 3)
                prompt = min(args.max_len, max(16, int(rng.lognormvariate(mu=4.5, sigma=0.7))))
                emb = episode_embeds(images, prompt, grad=False)
                new = rng.randint(8, args.max_new)
                out = lm.generate(
                    inputs_embeds=emb,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=True,
                    pad_token_id=0,
                )
                episodes.append((images, prompt, out.shape[1]))
                del emb, out
        # Training on the episodes, in micro-batches of one episode (gradient accumulation).
        with record_function(MARK + "train"):
            for images, prompt, generated in episodes:
                emb = episode_embeds(images, prompt + generated, grad=True)
                labels = torch.randint(0, args.vocab, emb.shape[:2])
                out = lm(inputs_embeds=emb, labels=labels)
                out.loss.backward()
                del emb, out, labels
            opt.step()
            opt.zero_grad(set_to_none=True)


def collect(prof):
    """(time, order, kind, payload) for every allocation, free and step marker, in time order."""
    from torch._C._profiler import _EventType

    events = []
    order = 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        order += 1
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            if str(f.device) == "cpu" and f.alloc_size != 0:
                events.append((node.start_time_ns, order, "mem", (f.ptr, f.alloc_size)))
        elif node.name.startswith(MARK):
            # Begin sorts before anything at the same time, end after.
            events.append((node.start_time_ns, -1, "begin", node.name[len(MARK) :]))
            events.append((node.end_time_ns, 1 << 62, "end", None))
        stack.extend(node.children)
    events.sort(key=lambda e: (e[0], e[1]))
    return events


def write(events, out):
    t0 = events[0][0] if events else 0
    live = {}
    counts = {"alloc": 0, "free": 0, "steps": 0, "dropped_frees": 0, "peak_live_bytes": 0}
    live_bytes = 0
    with open(out, "w") as f:
        for t, _, kind, payload in events:
            t_us = (t - t0) // 1000
            if kind == "begin":
                f.write(json.dumps({"op": "step_begin", "phase": payload}, separators=(",", ":")) + "\n")
                counts["steps"] += 1
            elif kind == "end":
                f.write('{"op":"step_end"}\n')
            else:
                ptr, size = payload
                if size > 0:
                    if ptr in live:
                        # An address given out twice without a free in between: the free was
                        # not recorded; treat the old block as gone.
                        f.write('{"op":"free","addr":%d,"t_us":%d}\n' % (ptr, t_us))
                        live_bytes -= live.pop(ptr)
                    live[ptr] = size
                    live_bytes += size
                    counts["peak_live_bytes"] = max(counts["peak_live_bytes"], live_bytes)
                    f.write('{"op":"alloc","addr":%d,"size":%d,"t_us":%d}\n' % (ptr, size, t_us))
                    counts["alloc"] += 1
                elif ptr in live:
                    live_bytes -= live.pop(ptr)
                    f.write('{"op":"free","addr":%d,"t_us":%d}\n' % (ptr, t_us))
                    counts["free"] += 1
                else:
                    counts["dropped_frees"] += 1
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["sft", "vlm-agent"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="training steps (sft) or rollout+train iterations")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-new", type=int, default=16, help="vlm-agent: most tokens generated per episode")
    p.add_argument("--vision-layers", type=int, default=2)
    p.add_argument(
        "--vision-hidden", type=int, default=256, help="vlm-agent: CLIP hidden size (MLP 4x, heads hidden/64, at least 4)"
    )
    p.add_argument("--image-size", type=int, default=224, help="vlm-agent: image side in pixels (patches of 16)")
    p.add_argument("--train-vision", action="store_true")
    p.add_argument("--eval-every", type=int, default=4)
    args = p.parse_args()
    sft_run = args.workload == "sft"
    args.steps = args.steps or (12 if sft_run else 2)
    args.batch = args.batch or (4 if sft_run else 3)
    args.layers = args.layers or (4 if sft_run else 2)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (sft if sft_run else vlm_agent)(args, rng)
    counts = write(collect(prof), args.out)
    print(f"{args.out}: {counts}", file=sys.stderr)


if __name__ == "__main__":
    main()
