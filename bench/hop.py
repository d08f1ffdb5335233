"""The cost of the hop itself, behind a backend that answers at once: ``bench.overhead --instant``.

    python -m bench.hop [--requests 400] [--tokens 8000] [--before CHECKOUT] [--litellm PATH]
                        [--vllm-router PATH] [--sessions N] [--profile DIR [--profile-native]]
                        [--saved-requests 40] [--prefill-rate 25000]

Kept as a short name; ``python -m bench.overhead --help`` describes the measurement.
"""

from __future__ import annotations

import sys

from bench.overhead import main

if __name__ == "__main__":
    main(["--instant", *sys.argv[1:]])
