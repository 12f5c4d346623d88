"""Taylor-Calibrate: convert a pretrained Transformer into a Gated DeltaNet hybrid (the method: docs/method.md).

Importing the package registers the hybrid's config and model with transformers' Auto* factories.
"""
import sys

# The CLI is starting (`python -m taylor_calibrate`: runpy sets argv[0] to "-m" while it imports the package; the
# console script's name): a Ctrl-C or SIGTERM during the imports below, before cli.main can catch it, prints one line.
if sys.argv[:1] == ["-m"] or sys.argv[0].endswith("taylor-calibrate"):
    def _ended_while_starting(signum, frame):
        """Ctrl-C or SIGTERM before cli.main installs its own handling: one line and the usual 128 + signal.

        It exits on the spot rather than raising: torch's import runs Python inside C++ (pybind11), and a
        KeyboardInterrupt raised there aborts the process (SIGABRT) instead of unwinding. Nothing is written yet.
        """
        import os

        what = "interrupted" if signum == signal.SIGINT else "terminated" if signum == signal.SIGTERM else "hung up"
        print(f"taylor-calibrate: {what} while starting; nothing was written", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    import signal

    signal.signal(signal.SIGINT, _ended_while_starting)
    signal.signal(signal.SIGTERM, _ended_while_starting)
    signal.signal(signal.SIGHUP, _ended_while_starting)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from taylor_calibrate.model.hybrid import HybridForCausalLM, convert_teacher  # noqa: E402
from taylor_calibrate.model.hybrid_config import HybridConfig  # noqa: E402
from taylor_calibrate.model.mixers.gdn import GDNConfig  # noqa: E402

__version__ = "0.1.0"

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = ["GDNConfig", "HybridConfig", "HybridForCausalLM", "convert_teacher"]
