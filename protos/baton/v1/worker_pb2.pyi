from baton_client.v1 import api_pb2 as _api_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVHandle(_message.Message):
    __slots__ = ("worker_id", "incarnation", "address", "lease_id", "block_ids", "num_tokens", "fingerprint", "expires_at", "block_crc32", "lease_port", "kv_dtype", "kv_layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_CRC32_FIELD_NUMBER: _ClassVar[int]
    LEASE_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    address: str
    lease_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    fingerprint: str
    expires_at: float
    block_crc32: _containers.RepeatedScalarFieldContainer[int]
    lease_port: int
    kv_dtype: str
    kv_layout: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., address: _Optional[str] = ..., lease_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., fingerprint: _Optional[str] = ..., expires_at: _Optional[float] = ..., block_crc32: _Optional[_Iterable[int]] = ..., lease_port: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _api_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "handle", "num_cached_tokens", "prefill_s", "first_logprob", "queue_s", "first_text", "cached_tokens_host", "cached_tokens_disk")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TEXT_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_HOST_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: str
    handle: KVHandle
    num_cached_tokens: int
    prefill_s: float
    first_logprob: _api_pb2.TokenLogprob
    queue_s: float
    first_text: str
    cached_tokens_host: int
    cached_tokens_disk: int
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[str] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prefill_s: _Optional[float] = ..., first_logprob: _Optional[_Union[_api_pb2.TokenLogprob, _Mapping]] = ..., queue_s: _Optional[float] = ..., first_text: _Optional[str] = ..., cached_tokens_host: _Optional[int] = ..., cached_tokens_disk: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "params", "handle")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    params: _api_pb2.SamplingParams
    handle: KVHandle
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., params: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ..., handle: _Optional[_Union[KVHandle, _Mapping]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "text", "finish_reason", "transfer", "num_cached_tokens", "logprobs", "queue_s", "cached_tokens_host", "cached_tokens_disk")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_HOST_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_DISK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: str
    transfer: TransferStats
    num_cached_tokens: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_api_pb2.TokenLogprob]
    queue_s: float
    cached_tokens_host: int
    cached_tokens_disk: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[str] = ..., transfer: _Optional[_Union[TransferStats, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_api_pb2.TokenLogprob, _Mapping]]] = ..., queue_s: _Optional[float] = ..., cached_tokens_host: _Optional[int] = ..., cached_tokens_disk: _Optional[int] = ...) -> None: ...

class LocalRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _api_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_api_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class TokenizerResponse(_message.Message):
    __slots__ = ("model", "tokenizer_json", "max_model_len")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_json: str
    max_model_len: int
    def __init__(self, model: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., max_model_len: _Optional[int] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("bytes", "blocks_read", "blocks_local", "handshake_s", "read_s", "release_s", "transports")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READ_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_LOCAL_FIELD_NUMBER: _ClassVar[int]
    HANDSHAKE_S_FIELD_NUMBER: _ClassVar[int]
    READ_S_FIELD_NUMBER: _ClassVar[int]
    RELEASE_S_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    blocks_read: int
    blocks_local: int
    handshake_s: float
    read_s: float
    release_s: float
    transports: str
    def __init__(self, bytes: _Optional[int] = ..., blocks_read: _Optional[int] = ..., blocks_local: _Optional[int] = ..., handshake_s: _Optional[float] = ..., read_s: _Optional[float] = ..., release_s: _Optional[float] = ..., transports: _Optional[str] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("fingerprint", "reader_id", "kv_dtype", "kv_layout")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    READER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    reader_id: str
    kv_dtype: str
    kv_layout: str
    def __init__(self, fingerprint: _Optional[str] = ..., reader_id: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("worker_id", "incarnation", "fingerprint", "agent_metadata", "kv_base_address", "block_nbytes", "num_blocks", "transports", "lease_port", "kv_mem_type", "kv_device_id", "kv_dtype", "kv_layout")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    KV_BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_MEM_TYPE_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    fingerprint: str
    agent_metadata: bytes
    kv_base_address: int
    block_nbytes: int
    num_blocks: int
    transports: str
    lease_port: int
    kv_mem_type: str
    kv_device_id: int
    kv_dtype: str
    kv_layout: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., fingerprint: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., kv_base_address: _Optional[int] = ..., block_nbytes: _Optional[int] = ..., num_blocks: _Optional[int] = ..., transports: _Optional[str] = ..., lease_port: _Optional[int] = ..., kv_mem_type: _Optional[str] = ..., kv_device_id: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., kv_layout: _Optional[str] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "incarnation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    incarnation: str
    def __init__(self, lease_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("intact", "reason")
    INTACT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    intact: bool
    reason: str
    def __init__(self, intact: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("check_integrity",)
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    def __init__(self, check_integrity: _Optional[bool] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "incarnation", "role", "fingerprint", "transports", "ucx_tls", "rss_bytes", "open_fds", "num_blocks", "num_free_blocks", "active_leases", "running_requests", "integrity_ok", "integrity_error", "leases_granted", "leases_expired", "known_peers", "handoffs_in_flight", "device", "kv_memory", "kv_staged_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    UCX_TLS_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    OPEN_FDS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    LEASES_GRANTED_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    KNOWN_PEERS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_MEMORY_FIELD_NUMBER: _ClassVar[int]
    KV_STAGED_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    role: str
    fingerprint: str
    transports: str
    ucx_tls: str
    rss_bytes: int
    open_fds: int
    num_blocks: int
    num_free_blocks: int
    active_leases: int
    running_requests: int
    integrity_ok: bool
    integrity_error: str
    leases_granted: int
    leases_expired: int
    known_peers: int
    handoffs_in_flight: int
    device: str
    kv_memory: str
    kv_staged_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[str] = ..., fingerprint: _Optional[str] = ..., transports: _Optional[str] = ..., ucx_tls: _Optional[str] = ..., rss_bytes: _Optional[int] = ..., open_fds: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., active_leases: _Optional[int] = ..., running_requests: _Optional[int] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ..., leases_granted: _Optional[int] = ..., leases_expired: _Optional[int] = ..., known_peers: _Optional[int] = ..., handoffs_in_flight: _Optional[int] = ..., device: _Optional[str] = ..., kv_memory: _Optional[str] = ..., kv_staged_bytes: _Optional[int] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role", "previous", "epoch")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    role: str
    previous: str
    epoch: int
    def __init__(self, role: _Optional[str] = ..., previous: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...
