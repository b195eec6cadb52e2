"""Disk deltas: ship only the elements whose rollout-precision bits changed (extra ``[delta]``).

``encode_delta`` / ``materialize_delta`` / ``apply_delta`` work on two HF checkpoint
directories; ``DeltaPublisher`` / ``DeltaSubscriber`` keep versioned ``weight_v{N:06d}/``
directories; ``update_engine_from_delta`` / ``update_engine_via_disk`` update an engine with a
pause only for the swap, and ``EngineFollower`` keeps an in-process engine on the newest
version with no disk copy on its side. zstd and xxhash are imported on first use (``pip install
'miles-transfer[delta]'``).
"""

from miles_transfer.delta.apply import VerifyReport, apply_delta, recover_target, verify_delta
from miles_transfer.delta.encode import DeltaReport, encode_delta
from miles_transfer.delta.engine import (
    EngineFollower,
    EngineUpdateReport,
    update_engine_from_delta,
    update_engine_via_disk,
)
from miles_transfer.delta.materialize import DeltaBaseError, MaterializeReport, materialize_delta
from miles_transfer.delta.publish import (
    DeltaPublisher,
    DeltaSubscriber,
    PublishReport,
    PullReport,
    read_latest,
    version_dir_name,
)

__all__ = [
    "DeltaBaseError",
    "DeltaPublisher",
    "DeltaReport",
    "DeltaSubscriber",
    "EngineFollower",
    "EngineUpdateReport",
    "MaterializeReport",
    "PublishReport",
    "PullReport",
    "VerifyReport",
    "apply_delta",
    "encode_delta",
    "materialize_delta",
    "read_latest",
    "recover_target",
    "update_engine_from_delta",
    "update_engine_via_disk",
    "verify_delta",
    "version_dir_name",
]
