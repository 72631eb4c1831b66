"""`make run`: a few built-in prompts through the embedded SmolLM2-135M-Instruct.

Prints each answer and the throughput (output tokens/s) of the batch.
"""

from __future__ import annotations

import argparse
import logging
import time

DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is in a language model.",
    "Give me three tips for staying focused while studying.",
    "What is 17 times 3?",
    "Translate 'good morning' into Spanish and German.",
]


def main(argv: list[str] | None = None) -> None:
    from atom import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    t0 = time.perf_counter()
    llm = LLM(dtype=args.dtype, num_kv_blocks=256, max_model_len=4096)  # the pool holds one full sequence
    print(f"engine started in {time.perf_counter() - t0:.1f} s")
    conversations = [[{"role": "user", "content": q}] for q in DEMO_QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - t0
    num_tokens = 0
    for question, out in zip(DEMO_QUESTIONS, outputs):
        completion = out.outputs[0]
        num_tokens += len(completion.token_ids)
        print(f"\n>>> {question}\n{completion.text.strip()}  [{completion.finish_reason}]")
    print(f"\n{len(outputs)} prompts, {num_tokens} output tokens in {elapsed:.2f} s: "
          f"{num_tokens / elapsed:.1f} output tokens/s (batch, {llm.config.resolved_dtype()})")
    llm.shutdown()


if __name__ == "__main__":
    main()
