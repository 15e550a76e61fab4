"""Lightning plugins: the Strategy (model transformation), the Precision plugin, callbacks."""

from lightning_sloth.plugins.callbacks import (
    ExpertLoadMonitor,
    GradientFlowError,
    GradientFlowGuard,
    OffloadStatsCallback,
    SaveAdapter,
    SlothThroughputMonitor,
)
from lightning_sloth.plugins.precision import SlothPrecision, resolve_precision
from lightning_sloth.plugins.strategy import SlothDDPStrategy, SlothFSDPStrategy, SlothStrategy

__all__ = [
    "ExpertLoadMonitor",
    "GradientFlowError",
    "GradientFlowGuard",
    "OffloadStatsCallback",
    "SaveAdapter",
    "SlothDDPStrategy",
    "SlothFSDPStrategy",
    "SlothPrecision",
    "SlothStrategy",
    "SlothThroughputMonitor",
    "resolve_precision",
]
