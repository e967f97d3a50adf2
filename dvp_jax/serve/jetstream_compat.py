"""What google-jetstream 0.2.2 needs from its surroundings that modern installs lack.

JetStream 0.2.2 is the last release (upstream is archived). Two gaps, both closed here at import:

1. `jax.tree_map`: JetStream's `orchestrator.delete_pytree` (run by the generate thread after
   every insert) calls it; modern JAX removed it, the AttributeError kills the thread and
   JetStream's `JetThread` then SIGKILLs the process. `jax.tree.map` is the same function.
2. `seqio`: `jetstream.engine.token_utils` (imported by `engine_api`, so by every Engine)
   imports `seqio.vocabularies.Vocabulary` and `SentencePieceVocabulary`, for type hints and
   for `load_vocab` (SentencePiece files), which dvp_jax never calls. The real seqio imports
   TensorFlow (2.2 GB installed, ~20 s to import). Unless seqio is already imported, a
   stand-in module provides the two names: an empty `Vocabulary` base class and a
   `SentencePieceVocabulary` that refuses to be built, saying why. `make install` meets
   JetStream's seqio requirement with a code-less distribution (packaging/seqio_standin).

Importing this module applies both. Only JetStream's users import it, before their first
`jetstream` import: `dvp_jax.serve.jetstream` (the adapter), `dvp_jax.serve.server` and the
test suite (tests/conftest.py). The trainer does not, so its users' `jax` is left unpatched.
"""

import sys
import types

import jax

if not hasattr(jax, "tree_map"):
    jax.tree_map = jax.tree.map


class Vocabulary:
    """Stand-in for `seqio.vocabularies.Vocabulary`: a base class JetStream names in hints."""


class SentencePieceVocabulary(Vocabulary):
    """Stand-in for seqio's SentencePiece vocabulary, which dvp_jax does not use."""

    def __init__(self, *args, **kwargs):
        del args, kwargs
        raise NotImplementedError(
            "SentencePiece vocabularies (seqio) are not available in dvp_jax: its tokenizers "
            "are dvp_jax.tokenizers (Hugging Face tokenizer.json or the char tokenizer)"
        )


def _install_seqio_stand_in() -> None:
    if "seqio" in sys.modules:  # the real one, imported by the user before us: keep it
        return
    package = types.ModuleType("seqio", "dvp_jax's stand-in (dvp_jax.serve.jetstream_compat)")
    package.__path__ = []  # a package, so `seqio.vocabularies` can be imported from it
    vocabularies = types.ModuleType("seqio.vocabularies", package.__doc__)
    vocabularies.Vocabulary = Vocabulary
    vocabularies.SentencePieceVocabulary = SentencePieceVocabulary
    package.vocabularies = vocabularies
    sys.modules["seqio"] = package
    sys.modules["seqio.vocabularies"] = vocabularies


_install_seqio_stand_in()
