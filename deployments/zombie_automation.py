"""Create (once) the automation that marks deployment flow runs left "Running" by a dead worker as
Crashed: flow runs emit a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (180 by default
since Prefect 3.6.22); when no flow-run event follows a heartbeat within three periods, the run is
set to CRASHED, which also frees its concurrency slot. Run by `make deploy`."""

from __future__ import annotations

import os
from datetime import timedelta

NAME = "dllm-flow: crash flow runs whose worker died"


def automation(window: timedelta, name: str = NAME):
    """The automation itself: after a flow run's heartbeat, expect another event of that run within
    `window`; if none comes, set the run CRASHED."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    return Automation(
        name=name,
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.*"},  # any later event of the same run (heartbeat or state) disarms it
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=window,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {int(window.total_seconds())} s: the worker or its machine died",
            )
        ],
    )


def main() -> None:
    from prefect.automations import Automation

    try:
        Automation.read(name=NAME)
        print(f"automation {NAME!r} already exists")
        return
    except Exception:  # noqa: BLE001 — not found (the client raises ValueError or an HTTP error by version)
        pass
    period = int(os.environ.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY") or 180)
    automation(timedelta(seconds=3 * period)).create()
    print(f"created automation {NAME!r} ({3 * period} s without a heartbeat → Crashed)")


if __name__ == "__main__":
    main()
