"""LightningDataModules and pure data helpers (tokenize, pack, shard); imported as ``lnstab.datamodules``."""

from lnstab.datamodules.openwebtext import OpenWebTextDataModule
from lnstab.datamodules.synthetic import SyntheticDataModule, TokenWindows
from lnstab.datamodules.text import DataError

__all__ = ["DataError", "OpenWebTextDataModule", "SyntheticDataModule", "TokenWindows"]
