"""Several gateway processes on one port (`pd-gateway serve --workers N`)."""
