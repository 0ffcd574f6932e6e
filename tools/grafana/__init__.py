"""The Grafana dashboard and the PromQL it is checked by."""
