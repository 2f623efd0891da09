"""The node's side of a coordinator config, as flags of the config commands.

``config-for-vllm`` and ``config-for-sglang`` size ``[instance]``, ``[region]`` and ``[kv]``
for an engine; these flags add what the node decides (the control socket, pinning, the
exporter, the disk tier, the event stream, the cluster tier), so the printed file is what
``tiercache serve --config`` runs as is, without hand edits. Every value goes through the
same ``Config`` validation as a file (one ``ConfigError`` naming the flag's key).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from tiercache.config.events import EventsConfig
from tiercache.config.model import Config
from tiercache.config.sections import ExporterConfig, PinningPolicy
from tiercache.config.tiers import ClusterConfig, DiskConfig
from tiercache.errors import ConfigError
from tiercache.sizes import parse_size

DEFAULT_PINNING = PinningPolicy.REQUIRED  # a node service pins or fails (README, "Pinning")


def add_node_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags, in their own help group."""
    g = parser.add_argument_group("the node's options (written into the config as given)")
    g.add_argument("--socket", metavar="PATH",
                   help="control.socket (default: $XDG_RUNTIME_DIR or /tmp/tiercache-<uid>, "
                        "then tiercache-<name>.sock)")
    g.add_argument("--pinning", choices=[p.value for p in PinningPolicy],
                   default=DEFAULT_PINNING.value,
                   help=f"region.pinning (default {DEFAULT_PINNING.value}: a worker that cannot "
                        "pin its slice fails instead of copying slower)")
    g.add_argument("--exporter-address", metavar="ADDR", default=ExporterConfig.address,
                   help=f"exporter.address (default {ExporterConfig.address})")
    g.add_argument("--exporter-port", metavar="PORT", type=int, default=ExporterConfig.port,
                   help=f"exporter.port (default {ExporterConfig.port})")
    g.add_argument("--disk-path", metavar="DIR", help="disk.path: turns the disk tier on")
    g.add_argument("--disk-capacity", metavar="SIZE", help="disk.capacity, e.g. 1TiB")
    g.add_argument("--events-endpoint", metavar="tcp://HOST:PORT",
                   help="events.endpoint: turns the node's KV event stream on")
    g.add_argument("--events-replay-endpoint", metavar="tcp://HOST:PORT",
                   help="events.replay_endpoint")
    g.add_argument("--cluster-master", metavar="HOST:PORT",
                   help="cluster.master: turns the cluster tier on (with the three below)")
    g.add_argument("--cluster-metadata-server", metavar="URL", help="cluster.metadata_server")
    g.add_argument("--cluster-local-hostname", metavar="HOST", help="cluster.local_hostname")
    g.add_argument("--cluster-key-file", metavar="PATH", help="cluster.key_file")
    g.add_argument("--cluster-segment-size", metavar="SIZE", help="cluster.segment_size")


def apply_node_arguments(config: Config, args: argparse.Namespace) -> Config:
    """``config`` with the node's flags applied; ``ConfigError`` for a flag without its
    partners (``--disk-path`` without ``--disk-capacity``, ...)."""
    region = replace(config.region, pinning=PinningPolicy(args.pinning))
    exporter = ExporterConfig(address=args.exporter_address, port=args.exporter_port)
    return replace(config, region=region, exporter=exporter,
                   control_socket=args.socket or "", disk=_disk(args), events=_events(args),
                   cluster=_cluster(args))


def _disk(args: argparse.Namespace) -> DiskConfig | None:
    if (args.disk_path is None) != (args.disk_capacity is None):
        raise ConfigError("--disk-path and --disk-capacity go together (the disk tier's "
                          "directory and its size)")
    if args.disk_path is None:
        return None
    return DiskConfig(path=args.disk_path,
                      capacity_bytes=parse_size(args.disk_capacity, "disk.capacity"))


def _events(args: argparse.Namespace) -> EventsConfig | None:
    if args.events_endpoint is None:
        if args.events_replay_endpoint is not None:
            raise ConfigError("--events-replay-endpoint needs --events-endpoint")
        return None
    return EventsConfig(endpoint=args.events_endpoint,
                        replay_endpoint=args.events_replay_endpoint or "")


_CLUSTER_FLAGS = ("cluster_master", "cluster_metadata_server", "cluster_local_hostname",
                  "cluster_key_file")


def _cluster(args: argparse.Namespace) -> ClusterConfig | None:
    given = [f for f in _CLUSTER_FLAGS if getattr(args, f) is not None]
    if not given and args.cluster_segment_size is None:
        return None
    missing = [f for f in _CLUSTER_FLAGS if f not in given]
    if missing:
        raise ConfigError("the cluster tier needs " + ", ".join(
            "--" + f.replace("_", "-") for f in missing))
    cluster = ClusterConfig(master=args.cluster_master,
                            metadata_server=args.cluster_metadata_server,
                            local_hostname=args.cluster_local_hostname,
                            key_file=args.cluster_key_file)
    if args.cluster_segment_size is None:
        return cluster
    return replace(cluster, segment_bytes=parse_size(args.cluster_segment_size,
                                                     "cluster.segment_size"))
