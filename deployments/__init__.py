"""How TRACE's flows are deployed, scheduled and pooled on a Prefect server (docs/deployments.md):
``python -m deployments.deploy`` creates the process work pools and registers the deployments."""
