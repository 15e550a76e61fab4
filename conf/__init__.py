"""Hydra config groups of the ``lightning-sloth`` app (``pkg://lightning_sloth.conf``).

Loading this package registers the structured-config schemas that the YAML files extend.
"""

from lightning_sloth.config import register_configs

register_configs()
