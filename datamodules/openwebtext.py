"""``OpenWebTextDataModule``: the paper's OpenWebText (GPT-2 BPE) from the hub, local files, prepared bins or a
synthetic stream, packed into ``block_size + 1`` windows, sharded over ranks x workers, resumable to the batch."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import os
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset

from lnstab import validation as require
from lnstab.datamodules.docsplit import VAL_SPLITS, split_documents
from lnstab.datamodules.packing import ArrayWindows, DocumentStream, ShardPlan
from lnstab.datamodules.prepare import head_documents
from lnstab.datamodules.prepared import read_meta, verify_split
from lnstab.datamodules.sample import SAMPLE_DOCUMENTS, sample_path
from lnstab.datamodules.synthetic import SyntheticDataModule, TokenWindows
from lnstab.datamodules.text import (
    DEFAULT_HF_CONFIG,
    DEFAULT_HF_DATASET,
    DEFAULT_HF_REVISION,
    SOURCES,
    DataError,
    DocStats,
    DocTokenizer,
    TextSpec,
    TooLittleData,
    hub_reachable,
    iter_documents,
    open_text_stream,
)
from lnstab.datamodules.vocab import VOCABS, VocabMap, compact_map, top_k_map
from lnstab.datamodules.worker_signals import SignalSafeDataLoader, ignore_stop_signals

log = logging.getLogger(__name__)
STATE_VERSION = 1
QUICKSTART_DATASET = "stas/openwebtext-10k"
VOCAB_FILE = "vocab.json"  # the run directory's record of a compact or top-K vocabulary


class OpenWebTextDataModule(pl.LightningDataModule):
    """OpenWebText (or any text) as GPT-2 tokens in ``(x, y)`` windows of ``block_size``.

    Sources (``source``):

    - ``hf``: stream ``dataset`` / ``dataset_config`` / ``revision`` / ``data_files`` from the hub (or a local
      dataset directory) through ``datasets.load_dataset(..., streaming=True)``; fails in seconds when offline.
    - ``files``: stream local ``.txt`` / ``.jsonl`` / ``.json`` / ``.parquet`` (gzip too) named by ``path``.
    - ``prepared``: ``path`` is a directory written by ``lnstab prepare`` (``train.bin``, ``val.bin``, ``meta.json``).
    - ``sample``: the 250 OpenWebText documents shipped with lnstab (:mod:`lnstab.datamodules.sample`; 279,376
      tokens), read as ``files``: real text, offline, too small for any result.
    - ``synthetic``: a seeded Markov token stream (no text), for smoke runs and benchmarks; only when asked.
    - ``auto``: ``files`` if ``path`` is set, else ``hf`` with ``stas/openwebtext-10k`` if the hub is reachable, else
      ``sample`` with a one-line note.

    The source actually used is stored as hyperparameter ``resolved_source`` (``source`` keeps what was asked).
    For ``hf``/``files`` the first documents holding ``val_tokens`` tokens are the validation set and training reads
    the rest; for ``prepared`` validation is ``val.bin`` (its first ``val_tokens`` tokens if set).

    Args:
        block_size: Tokens per window (linked to ``model.block_size``).
        batch_size: Windows per batch, per rank.
        source: ``hf``, ``files``, ``prepared``, ``sample``, ``synthetic`` or ``auto``.
        path: ``files``: file/dir/glob/comma list; ``prepared``: the prepared directory.
        dataset: ``hf``: dataset id or local dataset directory.
        dataset_config: ``hf``: config name.
        revision: ``hf``: git revision.
        data_files: ``hf``: ``data_files`` within the dataset.
        text_field: Column holding the text.
        split: Input split to read (``hf``/``files``).
        val_tokens: Validation tokens (streamed sources: held out from the head; ``None``: 1,048,576; prepared:
            ``None`` = all of ``val.bin``).
        tokenizer: tiktoken encoding name (``gpt2`` works offline).
        tokenizer_threads: Threads per reader for tokenization.
        num_workers: DataLoader workers per rank.
        seed: Seed of the window order (``prepared``/``synthetic``) and of the synthetic stream.
        synthetic_tokens: Length of the synthetic training stream.
        synthetic_vocab_size: Token ids of the synthetic stream lie in ``[0, synthetic_vocab_size)``.
        verify_checksums: Check the sha256 of prepared files in ``setup`` (sizes are always checked).
        val_split: ``head`` (validation is the first ``val_tokens`` tokens of the stream, the last document cut) or
            ``documents`` (``files`` or ``sample``: validation is the first ``val_documents`` whole documents,
            training every other one, no document in both; everything is tokenized once in ``setup`` and held in
            memory, and training takes aligned windows of the training documents, shuffled per pass by ``seed``).
            ``val_tokens``, if set, then keeps the first ``val_tokens`` of the validation documents' tokens.
        val_documents: With ``val_split: documents``: validation documents, a count (int) or a fraction (float in
            (0, 1)).
        vocab: ``full`` (GPT-2's ids), ``compact`` (exact relabelling of the distinct tokens of training and
            validation) or ``top_k`` (the ``vocab_top_k`` most frequent training tokens + one UNK id ``vocab_top_k``);
            see :mod:`lnstab.datamodules.vocab`. Needs ``val_split: documents``. The model's ``vocab_size`` must
            equal the vocabulary's size (``vocab_top_k + 1`` for ``top_k``; ``setup`` refuses another); the map is in
            :attr:`vocab_map`, in the checkpoint's data state and in ``vocab.json`` in the run directory.
        vocab_top_k: ``K`` of ``vocab: top_k``.

    Raises:
        DataError: In ``__init__`` for invalid options; in ``setup`` for missing/empty/corrupt data, a missing
            text field, an unreachable hub, or data shorter than one batch of windows.

    Example::

        dm = OpenWebTextDataModule(block_size=128, batch_size=8, source="files", path="owt.jsonl.gz",
                                   val_tokens=65536)
        dm.setup("fit")
        x, y = next(iter(dm.train_dataloader()))  # (8, 128) each; y is x shifted by one token
    """

    def __init__(
        self,
        block_size: int = 1024,
        batch_size: int = 32,
        source: str = "prepared",
        path: str | None = None,
        dataset: str = DEFAULT_HF_DATASET,
        dataset_config: str | None = DEFAULT_HF_CONFIG,
        revision: str | None = DEFAULT_HF_REVISION,
        data_files: str | list[str] | None = None,
        text_field: str = "text",
        split: str = "train",
        val_tokens: int | None = None,
        tokenizer: str = "gpt2",
        tokenizer_threads: int = 4,
        num_workers: int = 2,
        seed: int = 1337,
        synthetic_tokens: int = 1_000_000,
        synthetic_vocab_size: int = 50257,
        verify_checksums: bool = True,
        val_split: str = "head",
        val_documents: int | float | None = None,
        vocab: str = "full",
        vocab_top_k: int | None = None,
    ) -> None:
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__()
        args = self.check_args(**args)
        args["resolved_source"] = source
        if source == "auto":  # decided here so the logged hyperparameters name the source actually used
            args.update(self.resolve_auto(path))
        self.save_hyperparameters(args)
        self.batches_consumed = 0  # training batches this rank took (the checkpointed position)
        self._val: torch.Tensor | None = None
        self._val_docs = 0
        self._train_head: np.ndarray | None = None
        self._whole_tokens = 0  # tokens of data whose validation head read all of it (0: more is left to read)
        self._train: IterableDataset | None = None
        self._train_array: np.ndarray | None = None  # val_split documents: the training documents' tokens
        self.vocab_map: VocabMap | None = None  # vocab compact/top_k, after setup

    @staticmethod
    def check_args(**kwargs: Any) -> dict[str, Any]:
        """Every argument, as ``__init__`` takes them (defaults filled in), after the checks it makes before it reads
        any data; the CLI calls it first, so a bad ``--data.*`` is refused before anything else is said.

        Raises:
            DataError: One line naming the field and what is allowed.
        """
        bound = inspect.signature(OpenWebTextDataModule.__init__).bind(None, **kwargs)  # this class's, not a subclass's
        bound.apply_defaults()
        args = dict(bound.arguments)
        del args["self"]
        source, path, val_documents = args["source"], args["path"], args["val_documents"]
        require.choice("data.source", source, SOURCES, error=DataError)
        for name, low in (("block_size", 1), ("batch_size", 1), ("num_workers", 0), ("tokenizer_threads", 1),
                          ("synthetic_tokens", 2), ("synthetic_vocab_size", 2), ("seed", 0)):
            require.integer(f"data.{name}", args[name], low, error=DataError)
        if args["val_tokens"] is not None:
            require.positive_int("data.val_tokens", args["val_tokens"], error=DataError)
        if source in ("files", "prepared") and not path:
            raise DataError(f"--data.path is required with --data.source {source}")
        if isinstance(val_documents, float) and val_documents >= 1 and val_documents.is_integer():
            # jsonargparse on Python 3.12 reads `90` for `int | float` as 90.0: a whole number >= 1 is a count
            val_documents = args["val_documents"] = int(val_documents)
        OpenWebTextDataModule._check_split_and_vocab(source, path, args["val_split"], val_documents, args["vocab"],
                                                     args["vocab_top_k"])
        if source in ("sample", "synthetic") and path:
            raise DataError(f"--data.path {path} is not used with --data.source {source}; drop one (a file of your "
                            f"own: --data.source files)")
        return args

    @staticmethod
    def _check_split_and_vocab(source: str, path: str | None, val_split: str, val_documents: int | float | None,
                               vocab: str, vocab_top_k: int | None) -> None:
        require.choice("data.val_split", val_split, VAL_SPLITS, error=DataError)
        require.choice("data.vocab", vocab, VOCABS, error=DataError)
        if val_split == "documents":
            if not (source in ("files", "sample") or (source == "auto" and path)):
                raise DataError(f"--data.val_split documents is not allowed with --data.source {source}; it splits "
                                "local text: use --data.source files or sample (or auto with --data.path)")
            if isinstance(val_documents, bool) or not (
                (isinstance(val_documents, int) and val_documents >= 1)
                or (isinstance(val_documents, float) and 0 < val_documents < 1)
            ):
                raise DataError(f"--data.val_documents {val_documents!r} is not allowed with --data.val_split "
                                "documents; give a count >= 1 or a fraction in (0, 1)")
        elif val_documents is not None:
            raise DataError(f"--data.val_documents {val_documents!r} is not used with --data.val_split {val_split}; "
                            "set --data.val_split documents or drop it")
        if vocab != "full" and val_split != "documents":
            raise DataError(f"--data.vocab {vocab} is not allowed with --data.val_split {val_split}; the vocabulary "
                            "is built from the training tokens in memory: use --data.val_split documents")
        if vocab == "top_k":
            require.positive_int("data.vocab_top_k", vocab_top_k, error=DataError)
        elif vocab_top_k is not None:
            raise DataError(f"--data.vocab_top_k {vocab_top_k!r} is not used with --data.vocab {vocab}; set "
                            "--data.vocab top_k or drop it")

    # ------------------------------------------------------------------ source resolution and setup
    @staticmethod
    def resolve_auto(path: str | None) -> dict[str, Any]:
        """Hyperparameters for ``source: auto``: path -> ``files``; hub -> ``stas/openwebtext-10k``; else the packaged
        sample (``sample``)."""
        if path:
            return {"resolved_source": "files"}
        if hub_reachable(QUICKSTART_DATASET, DEFAULT_HF_REVISION):
            return {"resolved_source": "hf", "dataset": QUICKSTART_DATASET, "dataset_config": DEFAULT_HF_CONFIG,
                    "revision": DEFAULT_HF_REVISION}  # fmt: skip
        sample_path()  # installed with lnstab: a missing file fails here, in one line
        rank_zero_info(
            f"lnstab data: no --data.path and the Hugging Face hub is unreachable; training on the {SAMPLE_DOCUMENTS} "
            f"OpenWebText documents shipped with lnstab (recorded as source: sample)"
        )
        return {"resolved_source": "sample"}

    def resolve_source(self) -> str:
        """The source in use (``auto`` resolved in ``__init__``)."""
        return self.hparams.resolved_source

    def text_spec(self) -> TextSpec:
        """The :class:`TextSpec` of the ``hf``/``files``/``sample`` source."""
        hp, source = self.hparams, self.resolve_source()
        if source == "sample":
            return TextSpec("files", str(sample_path()), text_field="text", split="train")
        return TextSpec(
            source,
            hp.path,
            hp.dataset,
            hp.dataset_config,
            hp.revision,
            hp.data_files,
            hp.text_field,
            hp.split,
        )

    def setup(self, stage: str | None = None) -> None:
        """Resolve the source, check the data, build the validation tokens (all ranks, deterministic)."""
        if self._val is not None:
            self._check_model_vocab()
            if stage in ("fit", None):
                self._check_small_training_data()
            return
        hp, source = self.hparams, self.resolve_source()
        window, note = hp.block_size + 1, ""
        if source == "synthetic":
            n = hp.synthetic_tokens
            val_n = hp.val_tokens or max(window, n // 10)
            self._synthetic = SyntheticDataModule.markov_stream(n, hp.synthetic_vocab_size, hp.seed, 0).numpy()
            self._val = SyntheticDataModule.markov_stream(val_n, hp.synthetic_vocab_size, hp.seed + 1, 0)
        elif hp.val_split == "documents":
            note = self._setup_documents()
        elif source == "prepared":
            meta = read_meta(hp.path)
            self._meta = meta
            for split in ("train", "val"):
                verify_split(hp.path, meta, split, checksum=hp.verify_checksums)
            val = np.memmap(os.path.join(hp.path, meta["splits"]["val"]["file"]), dtype=meta["dtype"], mode="r")
            self._val = torch.from_numpy(np.asarray(val[: hp.val_tokens] if hp.val_tokens else val, dtype=np.int64))
        else:
            tok = DocTokenizer(hp.tokenizer, hp.tokenizer_threads)
            stats = DocStats()
            want = hp.val_tokens or 1 << 20
            train = stage in ("fit", None)  # validate/test/evaluate read no training data: all of a short file scores
            self._val_docs, arrays, ended = head_documents(self.text_spec(), tok, want, stats, train=train)
            note = f", {self._val_docs} documents ({stats.invalid_utf8} invalid UTF-8 replaced, {stats.blank} blank)"
            head = np.concatenate(arrays)
            # validation is exactly the first val_tokens tokens: a long (or the only) document is cut, and training
            # starts with the rest of it
            self._val = torch.from_numpy(head[:want].astype(np.int64))
            self._train_head = head[want:]
            self._whole_tokens = len(head) if ended else 0  # the training data is that rest alone (checked below)
        if self._val.numel() < window:
            raise DataError(
                f"--data.block_size {hp.block_size} is longer than the validation data ({self._val.numel()} tokens "
                f"from source {source}); it must be <= {self._val.numel() - 1}"
            )
        if stage in ("fit", None):  # validate/test/evaluate read no training data
            self._check_small_training_data()
        rank_zero_info(f"lnstab data: source={source}, validation {self._val.numel()} tokens{note}")
        self._check_model_vocab()

    def _check_small_training_data(self) -> None:
        """Data whose validation head held every document: the training tokens are the rest of the last one, all
        read by the first reader, so fewer than one batch, or more readers than one, would fail at the first training
        batch (after the run directory exists); refused at setup, before anything is written, in one line."""
        if not self._whole_tokens:
            return
        hp, have, total = self.hparams, len(self._train_head), self._whole_tokens
        need, readers = hp.batch_size * hp.block_size + 1, self.shard_plan().num_shards
        where = f"{self.text_spec().describe()} holds {total} tokens, {have} of them left to train on after " \
                f"validation's {self._val.numel()}"
        if have < need:
            raise TooLittleData(f"{where}; one batch needs --data.batch_size {hp.batch_size} x --data.block_size "
                                f"{hp.block_size} + 1 = {need}: give more text, or a smaller --data.val_tokens, "
                                "batch_size or block_size")
        if readers > 1:
            raise DataError(f"{where}, all in one document: --data.num_workers {hp.num_workers} on "
                            f"{self.shard_plan().world_size} device(s) makes {readers} readers, which split the "
                            "training data by document, so all but one would get none; give --data.num_workers 0 "
                            "on one device, or more documents")

    def _setup_documents(self) -> str:
        """``val_split: documents``: tokenize every document, split, relabel onto the vocabulary asked for."""
        hp = self.hparams
        tok = DocTokenizer(hp.tokenizer, hp.tokenizer_threads)
        stats = DocStats()
        train_docs, val_docs = split_documents(self.text_spec(), tok, hp.val_documents, stats)
        train, val = np.concatenate(train_docs), np.concatenate(val_docs)
        if hp.vocab == "top_k":
            if hp.vocab_top_k >= tok.encoding.n_vocab:
                raise DataError(f"--data.vocab_top_k {hp.vocab_top_k} is not allowed; it must be below the "
                                f"tokenizer's {tok.encoding.n_vocab} ids (use --data.vocab full or compact)")
            self.vocab_map = top_k_map(train, hp.vocab_top_k)
        elif hp.vocab == "compact":
            self.vocab_map = compact_map(train, val)
        vm = self.vocab_map
        if vm is not None:
            dtype = np.uint16 if vm.size <= 1 << 16 else np.int64
            train, val = vm.apply(train).astype(dtype), vm.apply(val).astype(dtype)
        self._val_docs, self._train_docs = len(val_docs), len(train_docs)
        self._val = torch.from_numpy(val[: hp.val_tokens] if hp.val_tokens else val).to(torch.int64)
        self._train_array = train
        note = f", {len(val_docs)} documents; training {len(train)} tokens, {len(train_docs)} documents"
        if vm is not None:
            unk = int((train == vm.unk).sum()) if vm.unk is not None else 0
            note += f"; vocab {hp.vocab}: {vm.size} ids" + (
                f", UNK {unk / len(train):.1%} of training tokens" if vm.unk is not None else "")
        return note

    def _check_model_vocab(self) -> None:
        """The model's ``vocab_size`` must be the relabelled vocabulary's size; ``vocab.json`` goes in the run dir."""
        vm, trainer = self.vocab_map, self.trainer
        if vm is None or trainer is None:
            return
        config = getattr(trainer.lightning_module, "config", None)
        size = getattr(config, "vocab_size", None)
        if size is not None and size != vm.size:
            raise DataError(f"model.vocab_size={size} is not allowed with --data.vocab {vm.kind}: the relabelled "
                            f"vocabulary has {vm.size} ids; set --model.vocab_size {vm.size}")
        if trainer.is_global_zero:
            from lnstab.rundir import run_dir, write_json, writes_files

            if not writes_files(trainer):
                return  # fast_dev_run: no file

            try:
                directory = run_dir(trainer)
            except Exception:  # noqa: BLE001 - a Trainer without a run directory (no logger): nothing to record in
                return
            directory.mkdir(parents=True, exist_ok=True)
            write_json(directory / VOCAB_FILE, vm.as_dict())

    @property
    def validation_documents(self) -> int:
        """Documents at the head of a text stream that validation read (the last one possibly cut)."""
        return self._val_docs

    @property
    def train_head_tokens(self) -> np.ndarray | None:
        """The rest of the last validation document, where validation cut it: training's first document."""
        return self._train_head

    def validation_tokens(self) -> torch.Tensor:
        """The validation stream, 1-D int64, documents separated by EOT 50256 (after ``setup``)."""
        if self._val is None:
            raise DataError("OpenWebTextDataModule.validation_tokens() needs setup('fit'|'validate'|'test') first")
        return self._val

    def token_id_limit(self) -> int:
        """Every token id is below this (a model's ``vocab_size`` must be at least this), known without reading data:
        the synthetic vocabulary, or the tokenizer's (``prepared``: the tokenizer recorded in ``meta.json``)."""
        hp, source = self.hparams, self.resolve_source()
        if source == "synthetic":
            return int(hp.synthetic_vocab_size)
        if hp.vocab == "top_k":
            return int(hp.vocab_top_k) + 1
        if hp.vocab == "compact":
            self.setup("fit")
            return self.vocab_map.size
        name = hp.tokenizer
        if source == "prepared":
            name = read_meta(hp.path).get("tokenizer", name)
        return int(DocTokenizer(name, 1).encoding.n_vocab)

    # ------------------------------------------------------------------ loaders
    def shard_plan(self, rank: int | None = None, world_size: int | None = None) -> ShardPlan:
        """This rank's :class:`ShardPlan` (rank/world from the trainer unless given)."""
        trainer = self.trainer
        rank = rank if rank is not None else (trainer.global_rank if trainer is not None else 0)
        world_size = world_size if world_size is not None else (trainer.world_size if trainer is not None else 1)
        return ShardPlan(rank, world_size, self.hparams.num_workers, self.batches_consumed)

    def train_dataset(self, plan: ShardPlan | None = None, passes: int | None = None) -> IterableDataset:
        """The training :class:`IterableDataset` of batches for ``plan`` (default: :meth:`shard_plan`)."""
        self.setup("fit")
        hp, plan = self.hparams, plan or self.shard_plan()
        source = self.resolve_source()
        if self._train_array is not None:
            return ArrayWindows(self._train_array, hp.block_size, hp.batch_size, plan, hp.seed, passes=passes)
        if source == "synthetic":
            return ArrayWindows(self._synthetic, hp.block_size, hp.batch_size, plan, hp.seed, passes=passes)
        if source == "prepared":
            path = os.path.join(hp.path, self._meta["splits"]["train"]["file"])
            return ArrayWindows(None, hp.block_size, hp.batch_size, plan, hp.seed, path, self._meta["dtype"], passes)
        return DocumentStream(
            self.text_spec(),
            hp.block_size,
            hp.batch_size,
            plan,
            self._val_docs,
            self._train_head,
            hp.tokenizer,
            hp.tokenizer_threads,
            passes,
            file_sharding=self.file_sharding_possible(plan.num_shards),
        )

    def file_sharding_possible(self, num_shards: int) -> bool:
        """Whether readers can take whole files: ``>= num_shards`` files, validation documents all in file 0."""
        if num_shards < 2:
            return False
        if getattr(self, "_n_files", None) is None:
            spec = self.text_spec()
            stream = open_text_stream(spec)
            self._n_files = stream.num_shards
            first = stream.shard(self._n_files, 0, contiguous=True) if self._n_files > 1 else stream
            docs = itertools.chain.from_iterable(iter_documents(first, spec, batch_docs=64))
            self._file0_docs = sum(1 for _ in itertools.islice(docs, self._val_docs))
        return self._n_files >= num_shards and self._n_files > 1 and self._file0_docs >= self._val_docs

    def train_dataloader(self) -> DataLoader:
        """Batches from :meth:`train_dataset`, continuing at the checkpointed position. Each epoch (Lightning
        iterates the loader again after ``limit_train_batches``) continues the stream where the last one stopped,
        so that a run resumed in a later epoch takes the batches the uninterrupted run took there."""
        ds = self.train_dataset()

        def continue_stream() -> None:
            ds.plan = dataclasses.replace(ds.plan, start_batch=self.batches_consumed)

        return self._loader(ds, continue_stream)

    def _loader(self, ds: Any, before_iter: Callable[[], None] | None = None) -> DataLoader:
        w = self.hparams.num_workers
        return SignalSafeDataLoader(
            ds, batch_size=None, num_workers=w, pin_memory=torch.cuda.is_available(), prefetch_factor=4 if w else None,
            worker_init_fn=ignore_stop_signals if w else None, before_iter=before_iter,
        )

    def val_dataloader(self) -> DataLoader:
        """Deterministic consecutive windows of :meth:`validation_tokens` (stride ``block_size``)."""
        self.setup("validate")
        ds = TokenWindows(self._val, self.hparams.block_size)
        return DataLoader(ds, batch_size=self.hparams.batch_size, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        """The validation windows."""
        return self.val_dataloader()

    # ------------------------------------------------------------------ position in the checkpoint
    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Count the training batches the loop actually takes (not what workers prefetched)."""
        trainer = self.trainer
        if trainer is not None and trainer.training and not trainer.sanity_checking:
            self.batches_consumed += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "source", "batches_consumed", "batch_size", "block_size", "num_workers", "world_size",
        "seed", "val_documents"}``: enough to continue with exactly the next batch."""
        hp, trainer = self.hparams, self.trainer
        return {
            "version": STATE_VERSION,
            "source": hp.resolved_source,
            "batches_consumed": self.batches_consumed,
            "batch_size": hp.batch_size,
            "block_size": hp.block_size,
            "num_workers": hp.num_workers,
            "world_size": trainer.world_size if trainer is not None else 1,
            "seed": hp.seed,
            "val_documents": self._val_docs,
            **({"vocab": self.vocab_map.as_dict()} if self.vocab_map is not None else {}),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at ``state_dict['batches_consumed']``; the layout that decides the order must be unchanged.

        Outside a fit (``lnstab evaluate``, ``validate``, ``test`` on a checkpoint) only the vocabulary must match (it
        gives the model's output ids their meaning): other data, batch size or source score the checkpoint on other
        data, as ``--data.*`` is documented to.

        Raises:
            DataError: If source, batch/block size, workers, world size or seed differ from the checkpoint.
        """
        hp, trainer = self.hparams, self.trainer
        fitting = trainer is None or trainer.state.fn is None or trainer.state.fn == "fit"
        now = {
            "source": self.resolve_source(),
            "batch_size": hp.batch_size,
            "block_size": hp.block_size,
            "num_workers": hp.num_workers,
            "seed": hp.seed,
            "world_size": trainer.world_size if trainer is not None else state_dict.get("world_size", 1),
        }
        for key, value in now.items():
            if fitting and state_dict.get(key) != value:
                raise DataError(
                    f"--data.{key} {value!r} differs from the checkpoint's {state_dict.get(key)!r}; exact resumption "
                    f"needs the same value"
                )
        mine = self.vocab_map.as_dict() if self.vocab_map is not None else None
        if "vocab" in state_dict and mine is not None and state_dict["vocab"] != mine:
            raise DataError(
                f"--data.vocab {hp.vocab}: this data's {mine['kind']} vocabulary ({mine['size']} ids) differs from the "
                f"checkpoint's ({state_dict['vocab'].get('size')} ids); exact resumption needs the same data"
            )
        self.batches_consumed = int(state_dict["batches_consumed"])
