"""Credit assignment: from rewards (and replay relevance) to token advantages ``[N, T]``.

Pure tensor math — no Lightning, Hydra or model code, no I/O — so every method can be tested
exactly on hand-made batches and reused outside the trainer.
"""

from mrtpo.core.credit.advantages import (
    gdpo_advantages,
    group_advantages,
    grpo_advantages,
    replay_mask,
    saw_weights,
)
from mrtpo.core.credit.cort import CoRT, cort_weights
from mrtpo.core.credit.distill import (
    TeacherScores,
    generalized_jsd,
    generalized_jsd_chunked,
    sampled_token_scores,
)
from mrtpo.core.credit.methods import (
    GDPO,
    GDPOSAW,
    GRPO,
    MRTPO,
    MRTPOSAW,
    AdvantageMethod,
    CreditInputs,
    CreditOutput,
    MRTPOJoint,
    MRTPOShuffle,
    RelevanceRequest,
)
from mrtpo.core.credit.opsd import OPSD
from mrtpo.core.credit.relevance import (
    beta_schedule,
    js_distance,
    js_distance_chunked,
    mrtpo_advantages,
    mrtpo_advantages_from_weights,
    relevance_weights,
    shuffle_weights,
)

__all__ = [
    "GDPO",
    "GDPOSAW",
    "GRPO",
    "MRTPO",
    "MRTPOSAW",
    "OPSD",
    "AdvantageMethod",
    "CoRT",
    "CreditInputs",
    "CreditOutput",
    "MRTPOJoint",
    "MRTPOShuffle",
    "RelevanceRequest",
    "TeacherScores",
    "beta_schedule",
    "cort_weights",
    "gdpo_advantages",
    "generalized_jsd",
    "generalized_jsd_chunked",
    "group_advantages",
    "grpo_advantages",
    "js_distance",
    "js_distance_chunked",
    "mrtpo_advantages",
    "mrtpo_advantages_from_weights",
    "relevance_weights",
    "replay_mask",
    "sampled_token_scores",
    "saw_weights",
    "shuffle_weights",
]
