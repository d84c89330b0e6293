//! What aya 0.14 cannot do with a BPF hash map. Reading a whole map in batches
//! (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6): one system call per [`BATCH`] entries, where aya's
//! iterator makes two calls per entry (next key, then lookup): a drain status walked a
//! million-entry flow table in 2.3 s that way, 0.6 to 0.7 s in batches (the rest is the
//! kernel's walk of its buckets). And taking an entry, reading and deleting it in one call
//! ([`Hash::take`]). The layout of the calls' arguments is aya-obj's kernel bindings.

use std::{
    marker::PhantomData,
    mem::{size_of, MaybeUninit},
    ops::ControlFlow,
    os::fd::{AsFd, AsRawFd},
    ptr,
};

use anyhow::{bail, ensure, Context, Result};
use aya::{
    maps::{MapFd, MapInfo, MapType},
    Pod,
};
use aya_obj::generated::{bpf_attr, bpf_cmd};

/// Entries asked for per call: 4096 walked a million flow entries in 0.72 s, 16384 in 0.67 s
/// (the benchmark of 2026-12-02 08:55), 65536 in 0.61 s with four times the buffers (a few
/// MB for the flow table). The kernel hands out
/// whole hash buckets, and refuses a batch smaller than the fullest bucket (ENOSPC): then the
/// buffers double, up to [`MAX_BATCH`].
const BATCH: usize = 16384;
const MAX_BATCH: usize = 1 << 20;
/// Calls answered EBUSY or EAGAIN retried in one walk before it fails.
const BUSY_RETRIES: u32 = 100;

/// A hash map (or LRU hash map) checked to have `K`'s keys and `V`'s values, which is what
/// makes the system calls below safe: the kernel reads and writes that many bytes.
pub struct Hash<K, V> {
    id: u32,
    fd: MapFd,
    _entries: PhantomData<fn(K) -> V>,
}

impl<K: Pod, V: Pod> Hash<K, V> {
    /// The hash map with id `map_id`.
    pub fn open(map_id: u32) -> Result<Self> {
        let info = MapInfo::from_id(map_id).with_context(|| format!("map {map_id}"))?;
        let kind = info.map_type()?;
        ensure!(
            matches!(kind, MapType::Hash | MapType::LruHash),
            "map {map_id} is a {kind:?}, not a hash map"
        );
        let (key_size, value_size) = (size_of::<K>(), size_of::<V>());
        ensure!(
            info.key_size() as usize == key_size && info.value_size() as usize == value_size,
            "map {map_id} has {}-byte keys and {}-byte values, not {key_size} and {value_size}",
            info.key_size(),
            info.value_size()
        );
        Ok(Hash {
            id: map_id,
            fd: info.fd()?,
            _entries: PhantomData,
        })
    }

    /// Deletes `key`'s entry and returns it, in one call (`BPF_MAP_LOOKUP_AND_DELETE_ELEM`,
    /// Linux 5.14 for hash maps): a program's update of the entry between a lookup and a
    /// delete of our own would be lost with it. None when there is no entry.
    pub fn take(&self, key: &K) -> Result<Option<V>> {
        // SAFETY: as in `for_each`.
        let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
        let mut value = MaybeUninit::<V>::zeroed();
        // SAFETY: writing plain integers into the union's element variant.
        let args = unsafe { &mut attr.__bindgen_anon_2 };
        args.map_fd = self.fd.as_fd().as_raw_fd() as u32;
        args.key = ptr::from_ref(key) as u64;
        args.__bindgen_anon_1.value = value.as_mut_ptr() as u64;
        // SAFETY: the kernel reads a key from `key` and writes a value into `value`, of the
        // sizes `open` checked; both outlive the call.
        let ret = unsafe { sys_bpf(bpf_cmd::BPF_MAP_LOOKUP_AND_DELETE_ELEM, &mut attr) };
        if ret == 0 {
            // SAFETY: the kernel wrote the value, and any bytes are a valid V (Pod).
            return Ok(Some(unsafe { value.assume_init() }));
        }
        match std::io::Error::last_os_error() {
            e if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
            e => Err(e).with_context(|| format!("taking an entry of map {}", self.id)),
        }
    }

    /// Hands every entry to `f`, until it breaks. Entries that come and go during the walk
    /// may be seen or not, as with any walk of a live map.
    pub fn for_each(&self, mut f: impl FnMut(K, V) -> ControlFlow<()>) -> Result<()> {
        let (fd, map_id) = (&self.fd, self.id);
        let (key_size, value_size) = (size_of::<K>(), size_of::<V>());
        let mut batch = BATCH;
        let mut keys = vec![0u8; batch * key_size];
        let mut values = vec![0u8; batch * value_size];
        // The position to go on from, which the kernel writes (a bucket index for a hash map);
        // room for a u64, whatever it holds.
        let (mut from, mut next) = (0u64, 0u64);
        let mut started = false;
        let mut busy = 0;
        loop {
            // SAFETY: an all-zero bpf_attr is valid, and zero is what the kernel expects of
            // every field not set below.
            let mut attr: bpf_attr = unsafe { std::mem::zeroed() };
            // SAFETY: writing plain integers into the union's batch variant.
            let args = unsafe { &mut attr.batch };
            args.in_batch = if started {
                ptr::from_ref(&from) as u64
            } else {
                0
            };
            args.out_batch = ptr::from_mut(&mut next) as u64;
            args.keys = keys.as_mut_ptr() as u64;
            args.values = values.as_mut_ptr() as u64;
            args.count = batch as u32;
            args.map_fd = fd.as_fd().as_raw_fd() as u32;
            // SAFETY: the kernel writes at most `count` keys and values into buffers of that many,
            // and one position into `next`; every pointer outlives the call.
            let ret = unsafe { sys_bpf(bpf_cmd::BPF_MAP_LOOKUP_BATCH, &mut attr) };
            let error = (ret < 0).then(std::io::Error::last_os_error);
            let last = match error.as_ref().and_then(std::io::Error::raw_os_error) {
                None => false,
                // The end: the entries of this last call are in the buffers.
                Some(libc::ENOENT) => true,
                Some(libc::ENOSPC) if batch < MAX_BATCH => {
                    batch *= 2;
                    keys.resize(batch * key_size, 0);
                    values.resize(batch * value_size, 0);
                    continue;
                }
                // A bucket held by a program on this CPU (the kernel will not spin on it): the
                // same batch again, a bounded number of times.
                Some(libc::EBUSY | libc::EAGAIN) if busy < BUSY_RETRIES => {
                    busy += 1;
                    std::thread::yield_now();
                    continue;
                }
                Some(_) => bail!(
                    "reading map {map_id} in batches: {}",
                    error.expect("an error")
                ),
            };
            // SAFETY: the kernel wrote back the number of entries it filled.
            let count = (unsafe { attr.batch.count } as usize).min(batch);
            for i in 0..count {
                // SAFETY: entry i lies within the buffers (i < batch), and any bytes are a valid
                // K or V (Pod); the buffers are bytes, hence the unaligned reads.
                let (k, v) = unsafe {
                    (
                        ptr::read_unaligned(keys.as_ptr().add(i * key_size).cast::<K>()),
                        ptr::read_unaligned(values.as_ptr().add(i * value_size).cast::<V>()),
                    )
                };
                if f(k, v).is_break() {
                    return Ok(());
                }
            }
            if last {
                return Ok(());
            }
            ensure!(
                count > 0 || !started || next != from,
                "reading map {map_id} in batches: no progress"
            );
            from = next;
            started = true;
        }
    }
}

/// The `bpf` system call `cmd` with `attr`: 0 or more when it worked, else -1 and the error
/// in errno.
///
/// # Safety
///
/// `attr` holds what `cmd` takes, and every pointer in it is valid for what the kernel reads
/// or writes through it for the whole call.
unsafe fn sys_bpf(cmd: bpf_cmd, attr: &mut bpf_attr) -> libc::c_long {
    // SAFETY: the caller's.
    unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            ptr::from_mut(attr),
            size_of::<bpf_attr>() as libc::c_uint,
        )
    }
}

/// Hands every entry of the hash map with id `map_id` to `f`, until it breaks (see
/// [`Hash::for_each`]).
pub fn for_each<K: Pod, V: Pod>(map_id: u32, f: impl FnMut(K, V) -> ControlFlow<()>) -> Result<()> {
    Hash::<K, V>::open(map_id)?.for_each(f)
}
