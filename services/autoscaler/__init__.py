"""The autoscaler: sizes the prefill and decode pools from observed load against SLOs."""
