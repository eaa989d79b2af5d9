"""Lightning's ``FSDPStrategy`` (FSDP1) on CPU processes, for tests.

Lightning refuses ``FSDPStrategy`` without a GPU accelerator through an exact-type check; torch's FSDP1 itself runs on
CPU with gloo when it is given ``device_id=cpu``, which ``SelfGuideModule._wrap_fsdp1`` passes (the strategy's root
device).  This subclass is the unchanged strategy under another type, so the FSDP1 code path runs in CI.  Nothing
else is overridden: what runs is what a GPU run executes, minus NCCL.
"""

from lightning.pytorch.strategies import FSDPStrategy


class CPUFSDPStrategy(FSDPStrategy):
    pass
