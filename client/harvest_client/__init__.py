"""harvest-client: the researchers' package for the residual-stream harvesting service.

    Client             harvest a corpus of any size into a dataset folder; fetch one job
    ActivationDataset  read one layer's token vectors over every job, for training
    HarvestSummary     what `Client.harvest` returns

Light on purpose (httpx, safetensors, numpy, tqdm, pyarrow, fsspec): it imports nothing of the
service, speaks its HTTP API and reads its files. torch is used only when asked for.
"""

from harvest_client.api import ApiError
from harvest_client.client import Client
from harvest_client.dataset import ActivationDataset, Batch
from harvest_client.download import VerificationError
from harvest_client.harvest import HarvestFailed, HarvestSummary
from harvest_client.stats import Moments, merge_moments

__all__ = ["Client", "ActivationDataset", "Batch", "HarvestSummary", "HarvestFailed", "ApiError",
           "VerificationError", "Moments", "merge_moments"]
__version__ = "0.1.0"
