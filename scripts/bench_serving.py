"""Serving benchmark (thin wrapper): the implementation is atom/benchmarks/serving.py, so
``atom bench serve ...`` and ``python scripts/bench_serving.py ...`` are the same program.

Against a running ``atom serve`` (or any OpenAI-compatible server):
``python scripts/bench_serving.py --base-url http://127.0.0.1:8000 --dataset-name random
--random-input-len 128 --random-output-len 64 --num-prompts 200 --request-rate 4``.
Run with ``--help`` for every flag.
"""

import sys

from atom.benchmarks.serving import main

if __name__ == "__main__":
    sys.exit(main())
