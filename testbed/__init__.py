"""The service's test bed, shared by tests/ and bench/: real servers and hosts on loopback (an
API replica under uvicorn, a multi-host topology in network namespaces, moto's S3), the run
stores a Prefect-free server uses, and the Hugging Face references values are checked against.
Nothing here is part of the service; bench/ imports from here, never from tests/."""
