"""Deprecated: the update deltas, their statistics and the sparse delta file moved to `trl_es.util.deltas` (save_model
writes deltas with them); this path keeps working, with a DeprecationWarning, for one release."""

import warnings

from ..util.deltas import (  # noqa: F401
    DELTA_FILE,
    FORMAT,
    METADATA_KEYS,
    apply_delta,
    check_same_architecture,
    delta_entries,
    load_delta,
    save_delta,
    threshold_masks,
    thresholded,
    update_statistics,
    weight_delta,
    write_model_delta,
)


warnings.warn(
    "trl_es.research.sparse moved to trl_es.util.deltas; the old path will be removed in the next release",
    DeprecationWarning,
    stacklevel=2,
)
