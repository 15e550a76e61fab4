"""Lightning plugins: the Strategy (model transformation), the Precision plugin, callbacks."""

from lightning_sloth.plugins.callbacks import (
    ExpertLoadMonitor,
    GradientFlowError,
    GradientFlowGuard,
    SaveAdapter,
    SlothThroughputMonitor,
)
from lightning_sloth.plugins.precision import SlothPrecision, resolve_precision
from lightning_sloth.plugins.strategy import (
    SlothDDPStrategy,
    SlothFSDPStrategy,
    SlothStrategy,
    find_hf_model,
)

__all__ = [
    "ExpertLoadMonitor",
    "GradientFlowError",
    "GradientFlowGuard",
    "SaveAdapter",
    "SlothDDPStrategy",
    "SlothFSDPStrategy",
    "SlothPrecision",
    "SlothStrategy",
    "SlothThroughputMonitor",
    "find_hf_model",
    "resolve_precision",
]
