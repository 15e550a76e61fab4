"""lightning_sloth: fast, lean LLM fine-tuning plugins for PyTorch Lightning.

Importing the package registers the ``"sloth"`` strategies with Lightning's registry.
"""

from lightning_sloth.data import PackedDataModule
from lightning_sloth.module import CausalLMModule, LoraSettings, OptimizerSettings
from lightning_sloth.plugins import (
    ExpertLoadMonitor,
    GradientFlowGuard,
    OffloadStatsCallback,
    SaveAdapter,
    SlothDDPStrategy,
    SlothFSDPStrategy,
    SlothPrecision,
    SlothStrategy,
    SlothThroughputMonitor,
)
from lightning_sloth.transform import SlothReport, transform_model

__version__ = "0.1.0"

__all__ = [
    "CausalLMModule",
    "ExpertLoadMonitor",
    "GradientFlowGuard",
    "OffloadStatsCallback",
    "LoraSettings",
    "OptimizerSettings",
    "PackedDataModule",
    "SaveAdapter",
    "SlothDDPStrategy",
    "SlothFSDPStrategy",
    "SlothPrecision",
    "SlothReport",
    "SlothStrategy",
    "SlothThroughputMonitor",
    "transform_model",
]
