"""Device placement: move to an accelerator (the one device resolver) and channels-last storage."""

from optkit.passes.device.passes import ChannelsLast, ToDevice, check_device, resolve_device

__all__ = ["ChannelsLast", "ToDevice", "check_device", "resolve_device"]
