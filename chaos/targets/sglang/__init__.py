"""A real SGLang PD deployment: prefill and decode servers, Mooncake between them, the router in front."""
