"""Taylor-Calibrate: convert a pretrained Transformer into a Gated DeltaNet hybrid (the method: docs/method.md).

Importing the package registers the hybrid's config and model with transformers' Auto* factories.
"""
import sys

# The CLI is starting (`python -m taylor_calibrate`: runpy sets argv[0] to "-m" while it imports the package; the
# console script's name): a Ctrl-C during the imports below, before cli.main can catch it, prints one line.
if sys.argv[:1] == ["-m"] or sys.argv[0].endswith("taylor-calibrate"):
    def _interrupted_while_starting(kind, value, tb, _default=sys.excepthook):
        """One line for a KeyboardInterrupt, not a traceback of torch's import; anything else as Python would."""
        if issubclass(kind, KeyboardInterrupt):
            print("taylor-calibrate: interrupted while starting; nothing was written", file=sys.stderr)
        else:
            _default(kind, value, tb)

    sys.excepthook = _interrupted_while_starting

    def _terminated_while_starting(signum, frame):
        """SIGTERM before cli.main installs its own handler: one line and the usual 128 + 15, not a silent kill."""
        print("taylor-calibrate: terminated while starting; nothing was written", file=sys.stderr)
        sys.exit(128 + signum)

    import signal

    signal.signal(signal.SIGTERM, _terminated_while_starting)

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from taylor_calibrate.model.hybrid import HybridForCausalLM, convert_teacher  # noqa: E402
from taylor_calibrate.model.hybrid_config import HybridConfig  # noqa: E402
from taylor_calibrate.model.mixers.gdn import GDNConfig  # noqa: E402

__version__ = "0.1.0"

AutoConfig.register(HybridConfig.model_type, HybridConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridConfig, HybridForCausalLM, exist_ok=True)

__all__ = ["GDNConfig", "HybridConfig", "HybridForCausalLM", "convert_teacher"]
