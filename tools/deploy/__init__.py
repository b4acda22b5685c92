"""Deploy helpers: a locally made Debian base image, and the checks of the container and systemd paths."""
