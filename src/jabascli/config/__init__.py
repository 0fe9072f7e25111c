"""Job configuration: typed models, TOML and seed-JSON loading."""

from jabascli.config.loader import LoadedConfig, ProfileDirs, load_config
from jabascli.config.models import JabasConfig, ServerConfig

__all__ = ["JabasConfig", "LoadedConfig", "ProfileDirs", "ServerConfig", "load_config"]
