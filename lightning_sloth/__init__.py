"""lightning_sloth: fast, lean LLM fine-tuning plugins for PyTorch Lightning.

Importing the package registers the ``"sloth"`` strategies with Lightning's registry.
"""

from lightning_sloth.module import CausalLMModule, LoraSettings, OptimizerSettings
from lightning_sloth.plugins import (
    ExpertLoadMonitor,
    GradientFlowGuard,
    SaveAdapter,
    SlothDDPStrategy,
    SlothFSDPStrategy,
    SlothPrecision,
    SlothStrategy,
    SlothThroughputMonitor,
)

__version__ = "0.1.0"

__all__ = [
    "CausalLMModule",
    "ExpertLoadMonitor",
    "GradientFlowGuard",
    "LoraSettings",
    "OptimizerSettings",
    "SaveAdapter",
    "SlothDDPStrategy",
    "SlothFSDPStrategy",
    "SlothPrecision",
    "SlothStrategy",
    "SlothThroughputMonitor",
]
