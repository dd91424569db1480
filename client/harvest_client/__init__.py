"""harvest-client: the researchers' package for the residual-stream harvesting service.

    Client             harvest a corpus of any size into a dataset folder; fetch one job
    ActivationDataset  read one layer's token vectors over every job, for training
    HarvestSummary     what `Client.harvest` returns

Errors: everything the client raises on purpose derives from `HarvestClientError`
(`harvest_client.errors`, where the tree is drawn):

    HarvestClientError
    ├── ConfigError            no API base or key
    ├── ApiError               the service's error answer (.status, .code, .message, .param)
    │   └── ServiceUnavailable a 503 still refused after its Retry-After
    ├── HarvestFailed          jobs failed or were cancelled
    ├── FolderError            the output folder holds another harvest
    └── VerificationError      a downloaded file does not match its manifest
        └── UnsafeManifest     a manifest file name outside the output folder

Light on purpose (httpx, safetensors, numpy, tqdm, pyarrow, fsspec): it imports nothing of the
service, speaks its HTTP API and reads its files. torch is used only when asked for.
"""

from harvest_client.client import Client
from harvest_client.dataset import ActivationDataset, Batch
from harvest_client.errors import (
    ApiError,
    ConfigError,
    FolderError,
    HarvestClientError,
    HarvestFailed,
    ServiceUnavailable,
    UnsafeManifest,
    VerificationError,
)
from harvest_client.harvest import HarvestSummary
from harvest_client.stats import Moments, merge_moments

__all__ = ["Client", "ActivationDataset", "Batch", "HarvestSummary", "HarvestClientError", "ConfigError", "ApiError",
           "ServiceUnavailable", "HarvestFailed", "FolderError", "VerificationError", "UnsafeManifest", "Moments",
           "merge_moments"]
__version__ = "0.1.0"
