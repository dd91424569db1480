"""`PrefectRuns` that hands its flow runs an environment of the test's choosing, for an API
under test on the session's real Prefect server and workers (`tests.faults_fixtures`).

The API starts runs with no environment of their own (production: the worker host's is
enough). The tests' workers were started before any test's registry existed, so the runs get
it here: `HARVEST_TEST_FLOW_ENV_FILE` names a JSON object read at every start, which a test
rewrites to slow its next job (`tests.slow_engine`). Everything else is `PrefectRuns` itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from api.runs import PrefectRuns
from harvest.lanes import load_lanes

__all__ = ["FlowEnvRuns", "write_flow_env"]


def write_flow_env(path: str | Path, env: dict[str, str]) -> None:
    staging = Path(f"{path}.tmp")
    staging.write_text(json.dumps(env))
    staging.replace(path)


class FlowEnvRuns(PrefectRuns):
    def start(self, job_id: str, request_url: str, model: str, lane: str, key_id: str) -> str:
        from flows.submit import start_harvest_run

        env = json.loads(Path(os.environ["HARVEST_TEST_FLOW_ENV_FILE"]).read_text())
        return str(start_harvest_run(job_id, request_url, model, lane, key_id, lane_config=load_lanes(self.settings).get(lane),
                                     key_queues=self.key_queues, env=env or None))
