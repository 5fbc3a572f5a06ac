"""One module per Hugging Face architecture, each defining ``ADAPTER`` (hf/adapter.py) that hf/registry.py
lists once. Only these modules name architectures; the converter core asks the registry.

Every module here is imported with the package, so a new family is its file plus its line in the registry."""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
